"""Linear layers and embeddings whose weights stay quantized (docs/quantization.md).

`QuantLinear` holds one packed matrix. On CPU it runs the C kernel (kernels/cpu/quant.py: the
matrix re-laid once into the kernel's tiles, activations quantized per row, integer dot products);
where no C compiler exists, and on GPU until the Triton kernels land, it runs the torch reference,
which dequantizes the matrix for each call (slow; correct). `QuantEmbedding` looks a step's tokens
up in a `QuantLinear` (with tied embeddings the same one the lm_head multiplies by), dequantizing
only those rows. `ConcatLinear` is a fused projection whose parts have different types (llama.cpp's
Q4_K_M gives v_proj or down_proj a bigger type than their neighbours): one GEMM per part.

`quantize_q8_0` makes the Q8_0 arrays of a float matrix (`quantization=int8`: int8 weights with a
float16 scale per 32 values, as llama.cpp's Q8_0), so float checkpoints reuse the same kernels.
`quantization=fp8` (CUDA, sm_89+) holds `FP8` matrices (kernels/quant_formats.py): e4m3 codes with
a float32 scale per output channel, run by the Triton W8 GEMM.
"""
from __future__ import annotations

import logging
from typing import Mapping, Optional, Sequence

import torch
from torch import nn

from kernels import quant_formats
from kernels.quant_reference import ARRAYS, QK

log = logging.getLogger(__name__)


def cpu_kernel(qtype: str, parts: Mapping[str, torch.Tensor]):
    """The C kernel's weight for CPU tensors, or None where it cannot be built (no compiler)."""
    from kernels.cpu import build as cpu_build
    from kernels.cpu import quant as cpu_quant
    try:
        return cpu_quant.CpuQuantWeight(qtype, parts)
    except cpu_build.CpuKernelUnavailable as exc:
        log.warning("quantized CPU kernel unavailable, using the torch reference (slow): %s", exc)
        return None


def packed_matmul(x: torch.Tensor, qtype: str, parts: Mapping[str, torch.Tensor],
                  bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [M, K] @ W.T (+ bias) for a packed matrix W (``parts``: its arrays, docs/quantization.md)
    on a device without the C kernel: on CUDA the Triton GEMMs (kernels/gpu/quant_dispatch.py, the
    arrays read as they are); elsewhere the torch reference, which dequantizes W for the call."""
    if x.is_cuda:
        from kernels.gpu.quant_dispatch import quant_linear  # triton loads with the first CUDA call
        return quant_linear(x, qtype, parts, bias)
    return quant_formats.linear_reference(x, qtype, parts, bias)


class QuantLinear(nn.Module):
    def __init__(self, qtype: str, parts: Mapping[str, torch.Tensor], bias: bool = False):
        super().__init__()
        arrays = ARRAYS.get(qtype) or quant_formats.ARRAYS.get(qtype)
        if arrays is None or set(arrays) - set(parts):
            raise ValueError(f"QuantLinear: a {qtype} matrix needs {', '.join(arrays or ('a known type',))}")
        self.qtype = qtype
        self.out_features, self.in_features = quant_formats.logical_shape(qtype, parts)
        device = parts["qweight"].device
        # The C kernels read GGUF's types; the GPU formats (FP8 ...) run the reference off CUDA.
        self.kernel = cpu_kernel(qtype, parts) if device.type == "cpu" and qtype in ARRAYS else None
        # The kernel keeps its own re-laid copy; the packed arrays stay only for the reference.
        self.parts = {} if self.kernel is not None else {k: v.contiguous() for k, v in parts.items()}
        self.bias = nn.Parameter(torch.zeros(self.out_features, device=device), requires_grad=False) if bias else None

    @property
    def weight_bytes(self) -> int:
        if self.kernel is not None:
            return self.kernel.nbytes
        return sum(t.numel() * t.element_size() for t in self.parts.values())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is None:
            return packed_matmul(x, self.qtype, self.parts, self.bias)
        bias = self.bias if self.bias is None or self.bias.dtype == torch.float32 else self.bias.float()
        if x.dtype == torch.float32:  # the CPU engine's activations: no conversion per call
            return self.kernel.matmul(x, bias)
        return self.kernel.matmul(x.float(), bias).to(x.dtype)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of the weight, dequantized, float32."""
        if self.kernel is not None:
            return self.kernel.rows(ids.reshape(-1)).view(*ids.shape, self.in_features)
        picked = {k: v[ids.reshape(-1)] for k, v in self.parts.items()}
        return quant_formats.dequantize(self.qtype, picked).view(*ids.shape, self.in_features)

    def extra_repr(self) -> str:
        where = f"C kernel ({self.kernel.isa})" if self.kernel is not None else "torch reference"
        return f"{self.qtype}, in_features={self.in_features}, out_features={self.out_features}, {where}"


class QuantEmbedding(nn.Module):
    """An embedding table kept quantized: each step dequantizes only its tokens' rows."""

    def __init__(self, table: QuantLinear):
        super().__init__()
        self.table = table  # shared with a tied lm_head: registered there too, counted once

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table.rows(ids)


class ConcatLinear(nn.Module):
    """A fused projection computed part by part (parts of different types), outputs side by side."""

    def __init__(self, parts: Sequence[nn.Module], bias: bool = False):
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.out_features = sum(p.out_features for p in parts)
        self.in_features = parts[0].in_features
        device = next(iter(parts[0].buffers()), torch.empty(0)).device
        self.bias = nn.Parameter(torch.zeros(self.out_features, device=device), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.cat([p(x) for p in self.parts], dim=-1)
        return out if self.bias is None else out + self.bias.to(out.dtype)


def concat_parts(parts: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The packed arrays of a fused matrix: each array of the parts stacked along its rows."""
    return {name: torch.cat([p[name] for p in parts]) for name in parts[0]}


def quantize_q8_0(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """A float matrix [N, K] (K a multiple of 32) -> Q8_0 arrays: per group of 32, scale =
    max|w| / 127 (stored float16) and codes round(w / scale), as llama.cpp's quantize_row_q8_0."""
    n, k = weight.shape
    if k % QK:
        raise ValueError(f"quantization=int8 needs rows of whole groups of {QK}; a weight has {k} columns")
    groups = weight.float().view(n, k // QK, QK)
    scale = (groups.abs().amax(dim=-1) / 127.0).half()
    inv = torch.where(scale.float() > 0, 1.0 / scale.float(), torch.zeros_like(scale, dtype=torch.float32))
    codes = torch.round(groups * inv[..., None]).clamp_(-127, 127).to(torch.int8)
    return {"qweight": codes.view(n, k), "scales": scale}


def quantized_bytes(modules: Sequence[nn.Module]) -> int:
    return sum(m.weight_bytes for m in modules if isinstance(m, QuantLinear))


def describe(types: Mapping[str, str]) -> str:
    counts: dict[str, int] = {}
    for t in types.values():
        counts[t] = counts.get(t, 0) + 1
    return ", ".join(f"{t} x{c}" for t, c in sorted(counts.items(), key=lambda kv: -kv[1]))


def fused_module_name(hf_prefix: str) -> Optional[str]:
    """The engine module a packed HF module feeds: q/k/v -> qkv_proj, gate/up -> gate_up_proj."""
    for part, fused in (("q_proj", "qkv_proj"), ("k_proj", "qkv_proj"), ("v_proj", "qkv_proj"),
                        ("gate_proj", "gate_up_proj"), ("up_proj", "gate_up_proj")):
        if hf_prefix.endswith("." + part):
            return hf_prefix[: -len(part)] + fused
    return None
