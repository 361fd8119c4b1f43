"""gpu-check's images case (issue 44, docs/vision.md): Gemma 3 vision through the engine on the GPU.

transformers writes a tiny random Gemma3ForConditionalGeneration (a two-layer SigLIP tower on
48-pixel images, 9 image tokens, a 13-token sliding window); the engine runs it in float32 on the
device with the plan's kernels, whole and chunked (a 16-token budget, so chunks are cut before
images; the CPU rehearsal runs the chunked one only): two requests with one and two images of
different sizes beside a text-only one. Their greedy
tokens must equal transformers' on the same device and pixels (float32: the same arithmetic, so equal
tokens, not a tolerance), the same image sent again must run no encoder, and every block must be back
at the end. On the GPU this is where the encoder, the image rows' scatter into the embeddings and the
bidirectional re-computation of an image's queries (backend/models/attention.py) meet device tensors
and the Triton prefill kernel. tests/test_vision_gemma3.py checks the same on the CPU.
"""
from __future__ import annotations

from pathlib import Path

BOI, EOI, IMAGE, PER_IMAGE, SIZE = 498, 499, 500, 9, 48
CASES = (([5, 6, BOI, 7, 8, 9], ((1, 30, 40),)), ([11, BOI, 12, 13, BOI, 14], ((2, 64, 48), (3, 48, 47))),
         ([40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50], ()))


def gemma3_text_config(max_positions: int = 512):
    """The tiny Gemma 3 text model of gpu-check (here and kv_tiers.py's grouped chat): layers 0 and 1
    slide over 13 tokens, layer 2 sees everything."""
    import transformers as tf
    return tf.Gemma3TextConfig(vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=24,
                               sliding_window=13, sliding_window_pattern=3, max_position_embeddings=max_positions,
                               initializer_range=0.1, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def _checkpoint(folder: Path) -> Path:
    import torch
    import transformers as tf
    torch.manual_seed(3)
    text = gemma3_text_config()
    vision = tf.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                   image_size=SIZE, patch_size=8, vision_use_head=False)
    config = tf.Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=PER_IMAGE,
                             image_token_index=IMAGE, boi_token_index=BOI, eoi_token_index=EOI, initializer_range=0.1)
    model = tf.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") and "vision" not in name:
                param.normal_(0, 0.3)
            elif name.endswith("mm_input_projection_weight"):
                param.normal_(0, 1.0)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def _image(seed: int, width: int, height: int):
    import numpy as np
    from PIL import Image
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


def _reference(model, prompt: list[int], images: list, device: str, max_tokens: int) -> list[int]:
    import numpy as np
    import torch

    from backend.core.images import ImageProcessing, preprocess
    ids = [t for x in prompt for t in ([BOI] + [IMAGE] * PER_IMAGE + [EOI] if x == BOI else [x])]
    kwargs = {}
    if images:
        pixels = np.stack([preprocess(i, ImageProcessing(size=SIZE)) for i in images])
        kwargs = dict(pixel_values=torch.from_numpy(pixels).to(device),
                      token_type_ids=torch.tensor([[int(t == IMAGE) for t in ids]], device=device))
    with torch.no_grad():
        model.generation_config.eos_token_id = None  # as ignore_eos: EOS may be chosen, nothing stops
        out = model.generate(input_ids=torch.tensor([ids], device=device), max_new_tokens=max_tokens,
                             do_sample=False, **kwargs)
    return out[0, len(ids):].tolist()


def vision_check(plan: dict, work: Path, device: str) -> dict:
    import torch
    import transformers as tf

    from backend import LLM, SamplingParams
    path = _checkpoint(work / "gemma3-vision")
    prompts = [({"prompt_token_ids": p, "multi_modal_data": {"image": [_image(*i) for i in imgs]}} if imgs else p)
               for p, imgs in CASES]
    hf = tf.Gemma3ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).to(device).eval()
    expected = [_reference(hf, p, [_image(*i) for i in imgs], device, plan["vision_max_tokens"]) for p, imgs in CASES]
    del hf
    results = {}
    for name, budget in plan["vision_budgets"]:
        llm = LLM(str(path), device=device, dtype="float32", attention_backend=plan["attention_backend"],
                  kv_block_size=16, max_model_len=512, max_num_batched_tokens=budget)
        try:
            params = SamplingParams(max_tokens=plan["vision_max_tokens"], temperature=0.0, ignore_eos=True)
            got = [o.token_ids for o in llm.generate(prompts, params)]
            runs = llm.stats()["encoder_runs_total"]
            again = llm.generate(prompts[:1], params)[0].token_ids
            stats = llm.stats()
        finally:
            llm.close()
        results[name] = dict(ok=got == expected and again == got[0] and stats["encoder_runs_total"] == runs == 3
                             and stats["kv_blocks_used"] == 0, equal=got == expected, encoder_runs=runs,
                             encoder_runs_after_repeat=stats["encoder_runs_total"], idle=stats["kv_blocks_used"] == 0)
    return dict(results, ok=all(r["ok"] for r in results.values()), device=device)
