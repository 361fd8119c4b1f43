"""Quantization at load: a float checkpoint's projections replaced, one matrix at a time, by
QuantLinears the engine runs as it runs imported GGUF weights (quantization=int8: Q8_0 on any
device; quantization=fp8: e4m3 on an Ada/Hopper GPU). backend/models/weights.py decides when."""
from __future__ import annotations

import logging
from typing import Callable

from torch import nn

from backend.models.llama import LlamaForCausalLM
from backend.models.moe import SparseMoeBlock, quantize_experts
from backend.models.quant_linear import QuantEmbedding, QuantLinear, quantize_q8_0
from kernels.quant_reference import QK

log = logging.getLogger(__name__)
__all__ = ["quantize_fp8_at_load", "quantize_int8"]


def quantize_int8(model: LlamaForCausalLM) -> None:
    """quantization=int8: every projection and the lm_head become Q8_0 QuantLinears (a tied
    embedding reads the lm_head's table), but for those whose inputs are not whole groups of 32
    (none in published models), which stay float, said in one log line."""
    tied = model.lm_head.weight is model.embed_tokens.weight
    routers = {f"{n}.gate" for n, m in model.named_modules() if isinstance(m, SparseMoeBlock)}
    inputs = {n: m.in_features for n, m in model.named_modules() if isinstance(m, nn.Linear) and n not in routers}
    kept = [n for n, k in inputs.items() if k % QK]
    for name in inputs:  # by name, so each float matrix is freed once replaced
        if name not in kept:
            _swap(model, name, "Q8_0", quantize_q8_0)
    if tied and "lm_head" not in kept:
        model.embed_tokens = QuantEmbedding(model.lm_head)
    # experts too, one Q8_0 matrix each; routers stay float (a small [E, H] matrix whose rounding
    # would move tokens between experts, which llama.cpp's quantizer leaves float too)
    if not quantize_experts(model, lambda w: QuantLinear("Q8_0", quantize_q8_0(w))):
        kept.append("experts")
    if kept:
        log.warning("quantization=int8: %d linear layer(s) kept float, their inputs not whole groups of "
                    "%d values: %s", len(kept), QK, ", ".join(kept[:4]) + (" ..." if len(kept) > 4 else ""))


def quantize_fp8_at_load(model: LlamaForCausalLM) -> None:
    """quantization=fp8: the decoder layers' projections become FP8 QuantLinears (e4m3, a float32
    scale per output channel, quantized where the weight lies: on the GPU). The embedding and the
    lm_head stay in the model's dtype, as vLLM's fp8 leaves them: the logits are the most
    sensitive product and a small share of the weights of the models fp8 is for."""
    from kernels.quant_formats import quantize_fp8

    names = [n for n, m in model.layers.named_modules() if isinstance(m, nn.Linear)]
    for name in names:  # by name, so each float matrix is freed once replaced (the peak: one more)
        _swap(model.layers, name, "FP8", quantize_fp8)


def _swap(root: nn.Module, name: str, qtype: str, quantize: Callable) -> None:
    """Replace the nn.Linear ``name`` under ``root`` by a QuantLinear of ``quantize(weight)``, its
    bias kept in float32."""
    parent, _, child = name.rpartition(".")
    owner = root.get_submodule(parent) if parent else root
    linear = getattr(owner, child)
    new = QuantLinear(qtype, quantize(linear.weight.detach()), bias=linear.bias is not None)
    if linear.bias is not None:
        new.bias.data.copy_(linear.bias.detach().float())
    setattr(owner, child, new)
