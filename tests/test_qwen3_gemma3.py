"""Qwen3 and Gemma 3 (text, and the text part of a Gemma3ForConditionalGeneration checkpoint) against
transformers on random-weight checkpoints it wrote itself: greedy tokens equal and log-probabilities
close, with and without chunked prefill, Gemma 3's prompts many sliding windows long (a 13-token
window), prefix reuse across the window's edge, the Triton kernels (interpreter) inside the engine,
and how the configuration is read. tests/test_engine_vs_hf.py runs both architectures through its
32-request workload too; tensor parallelism: tests/test_tensor_parallel_models.py."""
import json
import random

import pytest
import torch

from backend import LLM, SamplingParams
from backend.models.loader import load_model_config
from hf_checkpoints import GEMMA3_WINDOW, hf_greedy, make_checkpoint

ARCHS = {"qwen3": ("qwen3", False), "gemma3": ("gemma3", False), "gemma3-multimodal": ("gemma3", True)}
BLOCK = 16


def prompts_and_lengths(seed: int = 0):
    rng = random.Random(seed)
    lens = [1, 7, GEMMA3_WINDOW, GEMMA3_WINDOW + 1, 2 * BLOCK + 5, 61, 97]   # up to 7 windows long
    return [[rng.randrange(3, 512) for _ in range(n)] for n in lens], [9, 6, 8, 12, 7, 10, 9]


def hf_model(path, multimodal: bool):
    import transformers as tf
    cls = tf.Gemma3ForConditionalGeneration if multimodal else tf.AutoModelForCausalLM
    return cls.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="module", params=sorted(ARCHS))
def case(request, tmp_path_factory):
    arch, multimodal = ARCHS[request.param]
    path = make_checkpoint(arch, tmp_path_factory.mktemp(request.param), seed=4, multimodal=multimodal)
    model = hf_model(path, multimodal)
    prompts, max_tokens = prompts_and_lengths()
    return request.param, path, model, prompts, max_tokens, hf_greedy(model, prompts, max_tokens)


@pytest.mark.parametrize("chunked", [False, True])
def test_greedy_tokens_and_logprobs_match_transformers(case, chunked):
    """Chunks of 16 tokens cut the long prompts across window edges (a chunk's queries then read a
    window that starts in an earlier chunk)."""
    name, path, model, prompts, max_tokens, expected = case
    llm = LLM(str(path), kv_block_size=BLOCK, max_tokens_in_paged_kv_cache=2048, enable_chunked_context=chunked,
              max_num_batched_tokens=16 if chunked else 512)
    outputs = llm.generate(prompts, [SamplingParams(max_tokens=n, temperature=0, logprobs=3) for n in max_tokens])
    assert [o.token_ids for o in outputs] == expected
    worst = 0.0
    with torch.no_grad():
        for prompt, out in zip(prompts, outputs):
            ids = torch.tensor([prompt + out.token_ids])
            ref = torch.log_softmax(model(ids).logits[0].float(), dim=-1)[len(prompt) - 1:-1]
            for step, entries in enumerate(out.logprobs):
                assert set(entries) >= set(ref[step].topk(3).indices.tolist())
                worst = max(worst, max(abs(lp.logprob - float(ref[step, tok])) for tok, lp in entries.items()))
    assert worst < 1e-4, f"{name}: log-probabilities differ from transformers' by up to {worst:.2e}"
    assert llm.stats()["kv_blocks_used"] == 0
    llm.check_integrity()


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3", "gemma3"])
def test_the_triton_kernels_in_the_engine_agree_with_transformers(arch, tmp_path):
    """The Triton kernels under the interpreter inside the engine: windowed decode and prefill (a
    chunk of 24 after context, so a window starts in an earlier chunk), GeGLU, the q/k norm on the
    norm kernel; and the torch references (attention_backend=torch)."""
    path = make_checkpoint(arch, tmp_path / arch, seed=5)
    prompts = [p for p in prompts_and_lengths(1)[0] if len(p) in (GEMMA3_WINDOW + 1, 2 * BLOCK + 5)]
    assert len(prompts) == 2
    expected = hf_greedy(path, prompts, [5, 5])
    for backend in ("torch", "triton"):
        llm = LLM(str(path), attention_backend=backend, kv_block_size=BLOCK, max_tokens_in_paged_kv_cache=512,
                  max_num_batched_tokens=24, enable_chunked_context=True)
        assert llm.engine.runner.ops.name == backend
        outputs = llm.generate(prompts, SamplingParams(max_tokens=5, temperature=0))
        assert [o.token_ids for o in outputs] == expected, backend


@pytest.mark.parametrize("arch", ["qwen3", "gemma3"])
def test_bfloat16_weights_and_int8_on_the_cpu_paths(arch, tmp_path):
    """bf16 weights beside float32 activations (oneDNN's bf16 GEMMs; Gemma's norms stay float32 as
    1 + w) and int8 weights: the C kernels and the torch references give each prompt's first
    log-probabilities alike (random weights leave near ties, so not always the same tokens), and
    every request runs to its end."""
    path = make_checkpoint(arch, tmp_path / arch, seed=8)
    prompts = prompts_and_lengths(3)[0][3:6]
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=3)
    for setting in (dict(dtype="bfloat16"), dict(quantization="int8")):
        auto, torch_ = [LLM(str(path), attention_backend=b, kv_block_size=BLOCK, **setting).generate(prompts, params)
                        for b in ("auto", "torch")]
        assert [o.finish_reason for o in auto + torch_] == ["length"] * 6, setting
        for a, b in zip(auto, torch_):
            first_a, first_b = a.logprobs[0], b.logprobs[0]
            shared = set(first_a) & set(first_b)
            # int8: the C kernels quantize the activations too (as llama.cpp), the references do not
            assert len(shared) >= 2 and all(abs(first_a[t].logprob - first_b[t].logprob) < 0.05 for t in shared)


@pytest.mark.parametrize("arch", ["qwen3", "gemma3"])
def test_lora_on_every_projection_equals_the_merged_oracle(arch, tmp_path):
    """A PEFT adapter on all seven projections, its requests beside the base model's in one batch,
    against transformers with the adapter merged (lora_project runs on every projection of both)."""
    from lora_adapters import make_adapter, merged_oracle
    base = make_checkpoint(arch, tmp_path / arch, seed=7)
    adapter = make_adapter(base, tmp_path / "adapter", seed=1)
    prompts = prompts_and_lengths(2)[0][2:6]
    names = ["a", None, "a", None]
    llm = LLM(str(base), enable_lora=True, kv_block_size=BLOCK, lora_modules=f"a={adapter}")
    outputs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), lora_request=names)
    assert [o.token_ids for o in outputs] == merged_oracle(base, {"a": adapter}, prompts, names, 6)
    assert outputs[0].token_ids != llm.generate(prompts[:1], SamplingParams(max_tokens=6, temperature=0,
                                                                             ignore_eos=True))[0].token_ids


def test_prefix_reuse_across_the_window_edge(tmp_path):
    """Requests share a 53-token prefix (four windows, three whole blocks): the later ones attach the
    cached blocks and compute only their tails, whose local layers read the window that straddles
    the reused prefix and the new tokens."""
    path = make_checkpoint("gemma3", tmp_path / "gemma3", seed=6)
    rng = random.Random(3)
    system = [rng.randrange(3, 512) for _ in range(53)]
    prompts = [system + [rng.randrange(3, 512) for _ in range(rng.randint(1, 30))] for _ in range(6)]
    prompts += [system[:16], system + system[:5]]
    max_tokens = [rng.randint(1, 16) for _ in prompts]
    expected = hf_greedy(path, prompts, max_tokens)
    llm = LLM(str(path), enable_kv_cache_reuse=True, kv_block_size=BLOCK, max_tokens_in_paged_kv_cache=1024,
              max_num_batched_tokens=32, max_num_seqs=4)
    params = [SamplingParams(max_tokens=n, temperature=0) for n in max_tokens]
    outputs = llm.generate(prompts[:1], params[:1]) + llm.generate(prompts[1:], params[1:])
    assert [o.token_ids for o in outputs] == expected
    assert llm.stats()["prefix_cache_hit_tokens"] >= 3 * BLOCK * 6
    assert llm.stats()["kv_blocks_used"] == 0
    llm.check_integrity()


# -- configuration --------------------------------------------------------------------------------

def write_config(tmp_path, config: dict):
    (tmp_path / "config.json").write_text(json.dumps(config))
    return load_model_config(tmp_path)


def test_gemma3_layers_and_ropes_follow_the_pattern(tmp_path):
    """The Hub's gemma-3-4b-it config.json: a text_config that leaves most values to transformers'
    defaults, the old rope keys, and sliding_window_pattern in place of layer_types."""
    cfg = write_config(tmp_path, {
        "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
        "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                        "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                        "sliding_window": 1024}})
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (8, 4, 256, 262_208)
    assert cfg.layer_windows == tuple(0 if (i + 1) % 6 == 0 else 1024 for i in range(34))
    assert (cfg.rope_theta, cfg.rope_scaling) == (1_000_000.0, {"factor": 8.0, "rope_type": "linear"})
    assert (cfg.local_rope_theta, cfg.local_rope_scaling) == (10_000.0, None)
    assert cfg.attention_scale == 256 ** -0.5 and cfg.embedding_scale == 2560 ** 0.5
    assert (cfg.activation, cfg.qk_norm, cfg.sandwich_norms, cfg.norm_weight_offset) == ("gelu_tanh", True, True, 1.0)
    assert cfg.tie_word_embeddings and cfg.final_logit_softcapping is None


def test_sliding_windows_of_the_other_architectures(tmp_path):
    """Mistral slides every layer (no longer a cap on max_model_len); Qwen2/3 only with
    use_sliding_window, from max_window_layers on; Llama never."""
    base = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, vocab_size=100)
    mistral = write_config(tmp_path, dict(base, architectures=["MistralForCausalLM"], sliding_window=4096))
    assert mistral.layer_windows == (4096,) * 4
    qwen_off = write_config(tmp_path, dict(base, architectures=["Qwen3ForCausalLM"], sliding_window=4096))
    assert qwen_off.layer_windows == () and qwen_off.qk_norm
    qwen_on = write_config(tmp_path, dict(base, architectures=["Qwen3ForCausalLM"], sliding_window=64,
                                          use_sliding_window=True, max_window_layers=2))
    assert qwen_on.layer_windows == (0, 0, 64, 64)
    assert write_config(tmp_path, dict(base, architectures=["LlamaForCausalLM"])).layer_windows == ()


@pytest.mark.parametrize("key,value,match", [
    ("attn_logit_softcapping", 50.0, "attn_logit_softcapping"),
    ("use_bidirectional_attention", True, "use_bidirectional_attention"),
    ("hidden_activation", "relu", "hidden_activation is 'relu'"),
    ("layer_types", ["sliding_attention"], "layer_types is"),
])
def test_what_gemma3_configs_may_not_set_is_named(tmp_path, key, value, match):
    config = {"architectures": ["Gemma3ForCausalLM"], "num_hidden_layers": 2, key: value}
    with pytest.raises(ValueError, match=match):
        write_config(tmp_path, config)
