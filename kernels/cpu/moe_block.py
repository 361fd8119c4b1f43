"""A mixture-of-experts block after its router, in one C call (kernels/cpu/csrc/moe_block.c): the
route, the sort of (token, slot) pairs by expert, both projections of every active expert, the
activation·mul and the weighted sum into the tokens, and the engine's tally of tokens per expert.

- `route(logits, top_k, renormalize)`: the C route alone; its oracle is kernels/moe_reference.py
  `route` (the same experts, weights within float32 rounding).
- `CpuMoe.of(experts, top_k, renormalize)`: a block's experts in a layout the C call takes (packed
  experts on quant_gemm.c's `qgemm_experts`, float ones in moe_gemm.c's panels), or None.
- `CpuMoe(h, logits, valid)`: the block's output [T, hidden] for h [T, hidden] float32 and the
  router's logits [T, E]; its oracle is kernels/cpu/moe.py `sorted_moe` on `route`'s choice.
- `CpuMoe.struct`: the moe_t the C layer stack (kernels/cpu/decode_stack.py) calls it with, so the
  stack and the Python block (backend/models/moe.py) give the same bits.
"""
from __future__ import annotations

import ctypes
from typing import Optional

import torch

from kernels import checks as _common
from kernels.cpu import build as cpu_build
from kernels.cpu import moe as cpu_moe

NAME = "moe_block"
MAX_TOP_K = 64  # moe_block.c's
_P, _I = ctypes.c_void_p, ctypes.c_int64


class _Experts(ctypes.Structure):  # moe_block.c's experts_t
    _fields_ = [("gemm", _P), ("w", _P), ("panels_dtype", _I)]


class _Moe(ctypes.Structure):  # moe_block.c's moe_t
    _fields_ = [("gate_up", _Experts), ("down", _Experts), ("act_mul", _P), ("experts", _I), ("top_k", _I),
                ("renormalize", _I), ("hidden", _I), ("intermediate", _I), ("counts", _P)]


def _fn(name: str, argtypes: tuple, restype=None):
    return cpu_build.function(NAME, name, argtypes, restype=restype)


def _check_logits(name: str, logits: torch.Tensor, top_k: int) -> None:
    if logits.dtype != torch.float32 or logits.device.type != "cpu" or logits.dim() != 2 or not logits.is_contiguous():
        raise ValueError(f"{name}: router logits must be a contiguous float32 CPU tensor [T, E]; got "
                         f"{logits.dtype} {tuple(logits.shape)} on {logits.device}")
    if not 1 <= top_k <= min(logits.shape[1], MAX_TOP_K):
        raise ValueError(f"{name}: top_k = {top_k}; 1 to min(experts = {logits.shape[1]}, {MAX_TOP_K})")


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] float32 -> (weights [T, K] float32, ids [T, K] int32), best first."""
    _check_logits("moe route", logits, top_k)
    t, e = logits.shape
    weights = _common.alloc((t, top_k), torch.float32, logits.device)
    ids = _common.alloc((t, top_k), torch.int32, logits.device)
    if t:
        _fn("moe_route", (_P, _I, _I, _I, _I, _P, _P))(logits.data_ptr(), t, e, top_k, int(renormalize),
                                                       weights.data_ptr(), ids.data_ptr())
    return weights, ids


class CpuMoe:
    """One MoE block's experts (and its top_k, renormalization) as moe_block.c's moe_t."""

    def __init__(self, gate_up, down, *, num_experts: int, hidden: int, intermediate: int, top_k: int,
                 renormalize: bool, counts: Optional[torch.Tensor] = None):
        """gate_up, down: kernels/cpu/quant.py CpuQuantExperts (every expert's [gate | up] [2I, hidden],
        every down [hidden, I]), or pack_panels' float panels of the same. counts: the engine's
        tally of this layer's tokens per expert (int64 [E], added to in steps that pass `valid`)."""
        if not 1 <= top_k <= min(num_experts, MAX_TOP_K):
            raise ValueError(f"moe_block: top_k = {top_k}; 1 to min(experts = {num_experts}, {MAX_TOP_K})")
        self.hidden, self.num_experts, self.top_k = hidden, num_experts, top_k
        if counts is not None and (counts.dtype != torch.int64 or tuple(counts.shape) != (num_experts,)
                                   or not counts.is_contiguous() or counts.device.type != "cpu"):
            raise ValueError(f"moe_block: counts must be a contiguous int64 CPU tensor [{num_experts}]; got "
                             f"{counts.dtype} {tuple(counts.shape)} on {counts.device}")
        self._keep = (gate_up, down, counts)
        self.struct = _Moe(self._experts("gate_up", gate_up, hidden, 2 * intermediate, num_experts),
                           self._experts("down", down, intermediate, hidden, num_experts),
                           cpu_build.address(cpu_build.load("elementwise").silu_mul_f32), num_experts, top_k, int(renormalize), hidden,
                           intermediate, None if counts is None else counts.data_ptr())
        self._run = _fn("moe_block", (_P, _P, _P, _I, _P, _P, _P))
        self._scratch = _fn("moe_scratch_bytes", (_P, _I), restype=ctypes.c_int64)

    @classmethod
    def of(cls, experts, top_k: int, renormalize: bool, counts: Optional[torch.Tensor] = None) -> Optional["CpuMoe"]:
        """backend/models/moe.py Experts in the CPU kernels' layouts (panels, or packed experts of
        one type: `quant_experts`) as a CpuMoe; None for other layouts (one layer per expert of
        mixed or float types, stacked tensors), which keep the torch path."""
        if experts.w13_panels is not None:
            gate_up, down = experts.w13_panels, experts.w2_panels
        elif experts.quant_experts is not None:
            gate_up, down = experts.quant_experts
        else:
            return None
        return cls(gate_up, down, num_experts=experts.num_experts, hidden=experts.hidden,
                   intermediate=experts.intermediate, top_k=top_k, renormalize=renormalize, counts=counts)

    def _experts(self, what: str, w, k: int, n: int, experts: int) -> _Experts:
        from kernels.cpu import quant as cpu_quant
        if isinstance(w, cpu_quant.CpuQuantExperts):
            if (len(w.weights), w.in_features, w.out_features) != (experts, k, n):
                raise ValueError(f"moe_block: {what} holds {len(w.weights)} experts [{w.out_features}, "
                                 f"{w.in_features}]; expected {experts} of [{n}, {k}]")
            return _Experts(cpu_build.address(cpu_build.load(cpu_quant.NAME, w.weights[0].isa).qgemm_experts),
                            ctypes.addressof(w._structs), -1)
        if not isinstance(w, torch.Tensor):
            raise ValueError(f"moe_block: {what} must be packed experts or float panels; got {type(w).__name__}")
        e, columns, k_padded = cpu_moe.panel_shape(w)
        if e != experts or not columns - cpu_moe.PANEL < n <= columns or k_padded != k + (k % 2) * (w.dtype != torch.float32):
            raise ValueError(f"moe_block: {what} panels {tuple(w.shape)} do not hold {experts} experts of [{n}, {k}]")
        return _Experts(cpu_build.address(cpu_build.load(cpu_moe.NAME).moe_gemm), w.data_ptr(), cpu_moe.DTYPES[w.dtype])

    def scratch_bytes(self, rows: int) -> int:
        return self._scratch(ctypes.byref(self.struct), rows)

    def __call__(self, h: torch.Tensor, logits: torch.Tensor, valid: Optional[torch.Tensor] = None) -> torch.Tensor:
        """h [T, hidden] float32, logits [T, E] float32 -> [T, hidden] float32. `valid` (int64 [>= T]:
        1 a row to count, 0 padding): the tally counts this call's routing (when there is one)."""
        t = h.shape[0]
        if h.dtype != torch.float32 or h.device.type != "cpu" or h.dim() != 2 or h.shape[1] != self.hidden:
            raise ValueError(f"moe_block: h must be a float32 CPU tensor [T, {self.hidden}]; got "
                             f"{h.dtype} {tuple(h.shape)} on {h.device}")
        _check_logits("moe_block", logits, self.top_k)
        if tuple(logits.shape) != (t, self.num_experts):
            raise ValueError(f"moe_block: logits {tuple(logits.shape)}; expected [{t}, {self.num_experts}]")
        check_valid("moe_block", valid, t)
        h = h.contiguous()
        out = _common.alloc((t, self.hidden), torch.float32, h.device)
        if t:
            scratch = torch.empty(self.scratch_bytes(t), dtype=torch.uint8)
            self._run(ctypes.byref(self.struct), h.data_ptr(), logits.data_ptr(), t, out.data_ptr(),
                      None if valid is None else valid.data_ptr(), scratch.data_ptr())
        return out


def check_valid(name: str, valid: Optional[torch.Tensor], rows: int) -> None:
    """The tally's row weights: int64 [>= rows], contiguous, on the CPU (or None)."""
    if valid is not None and (valid.dtype != torch.int64 or valid.dim() != 1 or valid.shape[0] < rows
                              or not valid.is_contiguous() or valid.device.type != "cpu"):
        raise ValueError(f"{name}: the tally's valid rows must be a contiguous int64 CPU tensor [>= {rows}]; got "
                         f"{valid.dtype} {tuple(valid.shape)} on {valid.device}")
