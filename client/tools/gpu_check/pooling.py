"""gpu-check's pooling case (issue 44, docs/pooling.md): embeddings through the engine on the GPU.

transformers writes a tiny random Qwen3ForCausalLM; the engine serves it with `runner="pooling"` (a
causal LM keeps its LM head there, so generate and pooling share one engine) in float32 on the
device with the plan's kernels, chunked (a 16-token budget: the longer prompts pool across chunks,
the shortest is whole). Prompts of 5 to 23 tokens (not block multiples) are pooled by their last
token and normalized; each vector must equal transformers' (the hidden state after the final norm,
on the same device) to cosine >= 0.9999 with norm 1, a greedy request run beside them must still
equal transformers' tokens, and every block must be back at the end. tests/test_pooling.py checks the same on the CPU.
"""
from __future__ import annotations

from pathlib import Path

PROMPTS = ([5, 6, 7, 8, 9], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27],
           [30 + (7 * i) % 400 for i in range(23)])
GENERATE, MAX_TOKENS = [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50], 4


def _checkpoint(folder: Path) -> Path:
    import torch
    import transformers as tf
    torch.manual_seed(4)
    config = tf.Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                            initializer_range=0.1, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = tf.Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(1, 0.3)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def _references(path: Path, device: str):
    """transformers' normalized last-token hidden states of PROMPTS and greedy tokens of GENERATE."""
    import torch
    import transformers as tf
    hf = tf.Qwen3ForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    with torch.no_grad():
        vectors = [torch.nn.functional.normalize(  # the decoder's last hidden state: after the final norm
            hf.model(torch.tensor([p], device=device)).last_hidden_state[0, -1], dim=-1).cpu() for p in PROMPTS]
        hf.generation_config.eos_token_id = None  # as ignore_eos
        out = hf.generate(input_ids=torch.tensor([GENERATE], device=device), max_new_tokens=MAX_TOKENS,
                          do_sample=False)
    return vectors, out[0, len(GENERATE):].tolist()


def pooling_check(plan: dict, work: Path, device: str) -> dict:
    import torch

    from backend import LLM, SamplingParams
    path = _checkpoint(work / "qwen3-pooling")
    vectors, tokens = _references(path, device)
    results = {}
    for name, budget in (("chunked", 16),):  # (one engine: the dry run's time; the 5-token prompt is whole)
        llm = LLM(str(path), runner="pooling", device=device, dtype="float32",
                  attention_backend=plan["attention_backend"], kv_block_size=16, max_model_len=512,
                  max_num_batched_tokens=budget)
        try:
            pooled = [torch.as_tensor(o.pooled, dtype=torch.float32).cpu() for o in llm.embed(list(PROMPTS))]
            got = llm.generate([GENERATE], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                                          ignore_eos=True))[0].token_ids
            stats = llm.stats()
        finally:
            llm.close()
        cosines = [float(torch.nn.functional.cosine_similarity(a, b, dim=0)) for a, b in zip(pooled, vectors)]
        norm_error = max(abs(float(v.norm()) - 1) for v in pooled)  # normalized: cosine alone cannot tell
        results[name] = dict(ok=min(cosines) >= 0.9999 and norm_error < 1e-4 and list(got) == tokens
                             and stats["kv_blocks_used"] == 0, min_cosine=round(min(cosines), 6),
                             norm_error=norm_error, tokens_equal=list(got) == tokens,
                             idle=stats["kv_blocks_used"] == 0)
    return dict(results, ok=all(r["ok"] for r in results.values()), device=device)
