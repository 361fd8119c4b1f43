"""Pick the kernel implementations for a device and an `attention_backend` setting.

auto: the Triton kernels on CUDA; on CPU the C kernels (kernels/cpu/csrc, built on first use),
      or the references alone when the model is not float32 or no C compiler is there.
triton: the Triton kernels everywhere (on CPU they need TRITON_INTERPRET=1, set before triton loads).
torch: the references everywhere.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace
from typing import Callable

import torch

from kernels import moe_reference, reference

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class KernelOps:
    name: str
    store_kv: Callable
    decode_attention: Callable
    prefill_attention: Callable
    rms_norm: Callable
    rotary_embedding: Callable
    silu_mul: Callable
    gelu_tanh_mul: Callable  # Gemma's GeGLU
    # experts of a mixture-of-experts layer (kernels/moe_reference.py's signature); on CPU they may
    # be per-expert linear layers (oneDNN-packed, packed-quantized) instead of stacked tensors
    fused_moe: Callable = moe_reference.fused_moe


TORCH_OPS = KernelOps("torch", reference.store_kv, reference.decode_attention,
                      reference.prefill_attention, reference.rms_norm,
                      reference.rotary_embedding, reference.silu_mul, reference.gelu_tanh_mul)


def triton_ops() -> KernelOps:
    from kernels.gpu import triton_ops as t  # imported lazily: triton is heavy and GPU-oriented
    return KernelOps("triton", t.store_kv, t.decode_attention, t.prefill_attention, t.rms_norm,
                     t.rotary_embedding, t.silu_mul, t.gelu_tanh_mul, t.fused_moe)


def cpu_ops(dtype: torch.dtype) -> KernelOps:
    """The CPU engine's kernels for float32: C (kernels/cpu/csrc, built on first use) for decode
    and prefill attention, the cache store, RMSNorm, RoPE, SiLU·mul and GELU(tanh)·mul. (The C
    layer stack, backend/worker/native_decode.py, calls these same kernels, so its steps and the
    Python layers' agree bit for bit, prompt rows included.)"""
    if dtype != torch.float32:
        return TORCH_OPS
    from kernels.cpu import build as cpu_build
    from kernels.cpu import decode_attention as attn
    from kernels.cpu import elementwise as ew
    from kernels.cpu import prefill_attention as prefill
    try:
        cpu_build.load("decode_attention")
        cpu_build.load(prefill.NAME)
        cpu_build.load("elementwise")
    except cpu_build.CpuKernelUnavailable as e:
        log.warning("CPU kernels unavailable, using the torch references: %s", e)
        return TORCH_OPS
    return replace(TORCH_OPS, name="cpu", decode_attention=attn.decode_attention,
                   prefill_attention=prefill.prefill_attention, store_kv=ew.store_kv,
                   rms_norm=ew.rms_norm, rotary_embedding=ew.rotary_embedding, silu_mul=ew.silu_mul,
                   gelu_tanh_mul=ew.gelu_tanh_mul)


def get_ops(attention_backend: str, device: torch.device, dtype: torch.dtype = torch.float32) -> KernelOps:
    if attention_backend == "torch":
        return TORCH_OPS
    if attention_backend == "auto":
        return triton_ops() if device.type == "cuda" else cpu_ops(dtype)
    if attention_backend == "triton":
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("attention_backend=triton on CPU needs TRITON_INTERPRET=1 in the "
                             "environment before start-up (the Triton interpreter)")
        return triton_ops()
    raise ValueError(f"attention_backend must be auto, triton or torch; got '{attention_backend}'")
