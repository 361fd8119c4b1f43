"""Random-weight checkpoints written by transformers itself (test-only), and its greedy outputs.

Weights are drawn with initializer_range 0.1 so the logits of these tiny models are spread widely
enough that greedy choices do not hinge on float rounding.
"""
from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

COMMON = dict(vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
              max_position_embeddings=512, rms_norm_eps=1e-5, initializer_range=0.1,
              bos_token_id=1, eos_token_id=2, pad_token_id=0)

GEMMA3_WINDOW = 13  # the tiny Gemma 3's sliding window: not a block multiple, prompts run many windows

SHAPES = {
    # Llama with GQA 4:1 and llama3 rope scaling.
    "llama": dict(num_attention_heads=8, num_key_value_heads=2, rope_theta=500000.0,
                  rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "mistral": dict(num_attention_heads=4, num_key_value_heads=1, sliding_window=None),
    # Qwen2: q/k/v biases and tied embeddings.
    "qwen2": dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True),
    # Qwen3: q/k norm per head, a head_dim (32) apart from hidden / heads (16), GQA 2:1.
    "qwen3": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=False,
                  rope_theta=1000000.0),
    # Gemma 3: two local layers of a 13-token window, then a global one (so the prompts run several
    # windows long); each kind its own RoPE base, the global one linearly scaled (as Gemma 3 4B+);
    # query_pre_attn_scalar 24 is not the head_dim; a final logit soft-cap (Gemma 3 sets none, the
    # config may).
    "gemma3": dict(num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                   query_pre_attn_scalar=24, sliding_window=GEMMA3_WINDOW, sliding_window_pattern=3,
                   final_logit_softcapping=30.0,
                   rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                    "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                       "rope_theta": 1000000.0}}),
}
# Mixtures of experts (tests/test_moe_engine.py): 8 experts, top-2. Qwen3-MoE with 3 layers, the
# middle one dense (mlp_only_layers), and routing weights not renormalized (its default).
MOE_SHAPES = {
    "mixtral": dict(num_attention_heads=4, num_key_value_heads=2, intermediate_size=96, num_local_experts=8,
                    num_experts_per_tok=2),
    "qwen3_moe": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_hidden_layers=3,
                      num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, mlp_only_layers=[1],
                      norm_topk_prob=False),
}


def make_checkpoint(arch: str, out_dir: Path, seed: int = 0, multimodal: bool = False, **overrides) -> Path:
    """`arch`'s tiny random checkpoint in `out_dir`. `multimodal` (gemma3): saved as a
    Gemma3ForConditionalGeneration with a tiny vision tower, the text model under its prefix.
    `overrides`: config values in place of COMMON's and SHAPES'."""
    import transformers as tf
    config_cls = {"llama": tf.LlamaConfig, "mistral": tf.MistralConfig, "qwen2": tf.Qwen2Config,
                  "qwen3": tf.Qwen3Config, "gemma3": tf.Gemma3TextConfig, "mixtral": tf.MixtralConfig,
                  "qwen3_moe": tf.Qwen3MoeConfig}[arch]
    model_cls = {"llama": tf.LlamaForCausalLM, "mistral": tf.MistralForCausalLM,
                 "qwen2": tf.Qwen2ForCausalLM, "qwen3": tf.Qwen3ForCausalLM, "gemma3": tf.Gemma3ForCausalLM,
                 "mixtral": tf.MixtralForCausalLM, "qwen3_moe": tf.Qwen3MoeForCausalLM}[arch]
    torch.manual_seed(seed)
    config = config_cls(**{**COMMON, **SHAPES.get(arch, {}), **MOE_SHAPES.get(arch, {}), **overrides})
    if multimodal:
        vision = tf.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                       num_attention_heads=2, image_size=32, patch_size=8)
        config = tf.Gemma3Config(text_config=config.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4)
        model_cls = tf.Gemma3ForConditionalGeneration
    model = model_cls(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if arch == "qwen2" and name.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias")):
                param.normal_(0, 0.1)  # biases start at zero; make them matter
            elif arch in ("qwen3", "gemma3") and name.endswith("norm.weight"):
                param.normal_(0 if arch == "gemma3" else 1, 0.3)  # Gemma's start at 0 (its norm is 1 + w)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def hf_greedy(model_dir, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    """Greedy continuations from transformers in float32 on CPU, one prompt at a time. `model_dir`:
    a checkpoint folder, or a transformers model already loaded (a merged LoRA model, say)."""
    from transformers import AutoModelForCausalLM
    if isinstance(model_dir, (str, Path)):
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    else:
        model = model_dir.eval()
    outs = []
    with torch.no_grad():
        for prompt, n in zip(prompts, max_tokens):
            ids = torch.tensor([prompt])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                 min_new_tokens=0, do_sample=False, num_beams=1, pad_token_id=0)
            outs.append(gen[0, len(prompt):].tolist())
    return outs
