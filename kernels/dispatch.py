"""Pick the kernel implementations for a device and an `attention_backend` setting.

auto: the Triton kernels on CUDA, the torch references elsewhere.
triton: the Triton kernels everywhere (on CPU they need TRITON_INTERPRET=1, set before triton loads).
torch: the references everywhere.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

import torch

from kernels import reference


@dataclass(frozen=True)
class KernelOps:
    name: str
    store_kv: Callable
    decode_attention: Callable
    prefill_attention: Callable
    rms_norm: Callable
    rotary_embedding: Callable
    silu_mul: Callable


TORCH_OPS = KernelOps("torch", reference.store_kv, reference.decode_attention,
                      reference.prefill_attention, reference.rms_norm,
                      reference.rotary_embedding, reference.silu_mul)


def triton_ops() -> KernelOps:
    from kernels import triton_ops as t  # imported lazily: triton is heavy and GPU-oriented
    return KernelOps("triton", t.store_kv, t.decode_attention, t.prefill_attention, t.rms_norm,
                     t.rotary_embedding, t.silu_mul)


def get_ops(attention_backend: str, device: torch.device) -> KernelOps:
    if attention_backend == "torch":
        return TORCH_OPS
    if attention_backend == "auto":
        return triton_ops() if device.type == "cuda" else TORCH_OPS
    if attention_backend == "triton":
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("attention_backend=triton on CPU needs TRITON_INTERPRET=1 in the "
                             "environment before start-up (the Triton interpreter)")
        return triton_ops()
    raise ValueError(f"attention_backend must be auto, triton or torch; got '{attention_backend}'")
