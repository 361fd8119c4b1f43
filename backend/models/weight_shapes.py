"""A checkpoint's configuration held to its weights before anything is allocated (loader.py).

The model is built from config.json's counts and only then filled from the weights, so a count
the weights do not back would be allocated first: ``num_hidden_layers: 1000000`` on a two-layer
checkpoint grew the process for minutes, a huge ``vocab_size`` asked the allocator for terabytes.
`check_against_weights` reads only the safetensors headers (names and shapes, no data) and refuses,
in one line naming the key, its value and what the weights hold, a layer count above the layers
the weights have, and an embedding, a norm, the first layer's attention and MLP matrices, and a
mixture's router and first expert whose shapes differ from what the counts imply. A tensor that is
absent is left to the loader, which names it.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Iterable

from safetensors import SafetensorError, safe_open

from backend.models.checkpoint_config import CheckpointConfigError

# Where a checkpoint keeps the decoder's weights: Gemma3ForConditionalGeneration's text model sits
# under model.language_model. (transformers 5) or language_model.model. (the Hub's older files).
PREFIXES = ("model.language_model.", "language_model.model.", "language_model.", "model.")
SKIPPED = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.",
           "visual.", "model.visual.")  # (Qwen2.5-VL's vision encoder: backend/models/qwen2_5_vl_vision.py)
_LAYER = re.compile(r"^layers\.(\d+)\.")


def checkpoint_name(name: str) -> str:
    """A checkpoint name (``model.`` removed) in the engine's terms: Mixtral's block_sparse_moe is
    the layer's `mlp`."""
    return name.replace(".block_sparse_moe.", ".mlp.", 1)


def decoder_name(name: str) -> str:
    """A checkpoint tensor's name within the decoder (prefix off, Mixtral's block_sparse_moe as
    `mlp`), or "" for the tensors the loader skips."""
    if "rotary_emb.inv_freq" in name or name.startswith(SKIPPED):
        return ""
    prefix = next((p for p in PREFIXES if name.startswith(p)), "")
    return checkpoint_name(name[len(prefix):])


def header_shapes(files: Iterable[Path]) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape, by its decoder name, from the safetensors headers alone."""
    shapes: dict[str, tuple[int, ...]] = {}
    for path in files:
        try:
            with safe_open(str(path), framework="numpy") as f:
                for name in f.keys():
                    if decoder_name(name):
                        shapes[decoder_name(name)] = tuple(f.get_slice(name).get_shape())
        except SafetensorError as exc:  # a broken or truncated header: one line, not the library's traceback
            raise ValueError(f"{Path(path).name} is not a readable safetensors file: {exc}") from None
    return shapes


def _expected(cfg: Any) -> dict[str, tuple[tuple[str, int], ...]]:
    """Module -> its weight's dimensions, each as (what in the config sets it, the value)."""
    vocab, hidden = ("vocab_size", cfg.vocab_size), ("hidden_size", cfg.hidden_size)
    q = (f"num_attention_heads {cfg.num_heads} x head_dim", cfg.num_heads * cfg.head_dim)
    kv = (f"num_key_value_heads {cfg.num_kv_heads} x head_dim", cfg.num_kv_heads * cfg.head_dim)
    dims = {"embed_tokens": (vocab, hidden), "norm": (hidden,), "layers.0.self_attn.q_proj": (q, hidden),
            "layers.0.self_attn.k_proj": (kv, hidden), "layers.0.self_attn.v_proj": (kv, hidden),
            "layers.0.self_attn.o_proj": (hidden, q)}
    if not cfg.tie_word_embeddings:
        dims["lm_head"] = (vocab, hidden)
    if cfg.qk_norm:
        dims["layers.0.self_attn.q_norm"] = (("head_dim", cfg.head_dim),)
    moe = next((i for i in range(cfg.num_layers) if cfg.is_moe_layer(i)), None)
    if not cfg.is_moe_layer(0):
        dims["layers.0.mlp.gate_proj"] = (("intermediate_size", cfg.intermediate_size), hidden)
    if moe is not None:
        experts, inter = ("num_experts", cfg.num_experts), ("moe_intermediate_size", cfg.moe_intermediate_size)
        dims[f"layers.{moe}.mlp.gate"] = (experts, hidden)
        for part in ("w1", "gate_proj"):  # Mixtral's, Qwen3-MoE's: per expert, or stacked (packed)
            dims[f"layers.{moe}.mlp.experts.0.{part}"] = (inter, hidden)
            dims[f"layers.{moe}.mlp.experts.{part}"] = (experts, inter, hidden)
    return dims


def check_against_weights(cfg: Any, shapes: dict[str, tuple[int, ...]], where: str = "config.json: ") -> None:
    """`cfg` (a ModelConfig) against the weights' `shapes` (decoder name -> shape); see the module."""
    layers = {int(m.group(1)) for name in shapes if (m := _LAYER.match(name))}
    if cfg.num_layers > len(layers):
        raise CheckpointConfigError(f"{where}num_hidden_layers is {cfg.num_layers}; it must be at most "
                                    f"{len(layers)}, the layers the weights hold")
    for module, dims in _expected(cfg).items():
        want = tuple(value for _, value in dims)
        if f"{module}.weight" in shapes:  # a float weight: every dimension
            name, got = f"{module}.weight", shapes[f"{module}.weight"]
        elif f"{module}.qweight" in shapes:  # packed (docs/quantization.md): the rows, not the packed columns
            name, got, want = f"{module}.qweight", shapes[f"{module}.qweight"][:len(want) - 1], want[:-1]
        else:
            continue
        if tuple(got) != want:
            wrong = next((i for i, (g, w) in enumerate(zip(got, want)) if g != w), 0)
            key, value = dims[wrong]
            raise CheckpointConfigError(f"{where}{key} is {value}; it must be {got[wrong] if wrong < len(got) else '?'}, "
                                        f"as the weights' {name} of shape {list(shapes[name])} has it")
