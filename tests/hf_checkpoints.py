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

SHAPES = {
    # Llama with GQA 4:1 and llama3 rope scaling.
    "llama": dict(num_attention_heads=8, num_key_value_heads=2, rope_theta=500000.0,
                  rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "mistral": dict(num_attention_heads=4, num_key_value_heads=1, sliding_window=None),
    # Qwen2: q/k/v biases and tied embeddings.
    "qwen2": dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True),
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


def make_checkpoint(arch: str, out_dir: Path, seed: int = 0, **overrides) -> Path:
    import transformers as tf
    config_cls = {"llama": tf.LlamaConfig, "mistral": tf.MistralConfig, "qwen2": tf.Qwen2Config,
                  "mixtral": tf.MixtralConfig, "qwen3_moe": tf.Qwen3MoeConfig}[arch]
    model_cls = {"llama": tf.LlamaForCausalLM, "mistral": tf.MistralForCausalLM,
                 "qwen2": tf.Qwen2ForCausalLM, "mixtral": tf.MixtralForCausalLM,
                 "qwen3_moe": tf.Qwen3MoeForCausalLM}[arch]
    torch.manual_seed(seed)
    config = config_cls(**{**COMMON, **SHAPES.get(arch, {}), **MOE_SHAPES.get(arch, {}), **overrides})
    model = model_cls(config).eval()
    if arch == "qwen2":  # biases start at zero; make them matter
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.1)
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
