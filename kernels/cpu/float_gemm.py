"""GEMMs on float weights on the CPU (kernels/cpu/csrc/float_gemm.c): float32, bfloat16 and float16
matrices as torch holds them, float32 activations; and the choice of its build for this CPU.

`CpuFloatWeight(weight)` points the kernel at a [N, K] tensor (no copy: it keeps a reference);
`matmul(x, bias)` is one C call. Its oracle is `reference`: torch's float32 product, with the
activations rounded to bfloat16 first where the build multiplies bfloat16 pairs (vdpbf16ps).

Which build runs (`chosen_isa`), as kernels/cpu/quant.py chooses its own (kernels/cpu/build.py
`first_that_runs`): the best of BUILDS whose instructions /proc/cpuinfo lists AND whose `probe` ran
in a child process and got the right sum (a VM may list instructions it kills a process for), with
one log line saying which and why not the others. `INFLIGHT_FLOAT_ISA` forces one of BUILDS; `INFLIGHT_CPU_ISA` (quant.py's) caps it:
avx2 or avx_vnni run the AVX2 build at most, portable the portable one, so forcing the packed
kernels' AVX2 build forces this one's too.
"""
from __future__ import annotations

import ctypes
import functools
import logging
import os

import torch

from kernels.cpu import build as cpu_build
from kernels.cpu import quant as cpu_quant

log = logging.getLogger(__name__)
NAME = "float_gemm"
TYPE_IDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # float_gemm.c's F32, BF16, F16
K_MULTIPLE = 32
BUILDS = ("avx512_bf16", "avx512", "avx2", "portable")  # best first (kernels/cpu/build.py ISA_FLAGS)
AVX512 = ("avx512f", "avx512bw", "avx512vl", "avx512dq", "fma", "f16c")
NEEDS = {"avx512_bf16": AVX512 + ("avx512_bf16",), "avx512": AVX512, "avx2": ("avx2", "fma", "f16c")}
CAPS = {"amx_int8": "avx512_bf16", "avx512_vnni": "avx512_bf16", "avx_vnni": "avx2", "avx2": "avx2", "portable": "portable"}
BF16_PAIRS = ("avx512_bf16",)  # builds that round the activations to bfloat16 for bfloat16 weights
_P, _I = ctypes.c_void_p, ctypes.c_int64


class _FWeight(ctypes.Structure):  # fweight_t in float_gemm.c
    _fields_ = [("w", _P), ("type", _I), ("N", _I), ("K", _I)]


def _probe_expected() -> float:
    """What float_gemm.c's `probe` must return (its comment)."""
    w = [float((i * 7) % 13 - 6) for i in range(5 * 64)]
    x = [float(i % 9 - 4) for i in range(64)]
    return 2.0 * sum(w[n * 64 + k] * x[k] for n in range(5) for k in range(64))


def _probe_runs(isa: str) -> tuple[bool, str]:
    try:
        path = cpu_build.build(NAME, isa)
    except cpu_build.CpuKernelUnavailable as e:  # an older gcc without -mavx512bf16: the next build
        return False, f"it did not compile ({str(e).splitlines()[-1][:200]})"
    return cpu_quant.probe_library(path, _probe_expected())


@functools.lru_cache(maxsize=None)
def chosen_isa() -> str:
    """The build of float_gemm.c this process uses."""
    forced = cpu_build.forced_build("INFLIGHT_FLOAT_ISA", BUILDS)
    if forced:
        log.info("float GEMM: the %s build (INFLIGHT_FLOAT_ISA)", forced)
        return forced
    cap = os.environ.get("INFLIGHT_CPU_ISA")
    start = BUILDS.index(CAPS[cap]) if cap in CAPS else 0
    isa, passed_over = cpu_build.first_that_runs(BUILDS[start:], NEEDS, _probe_runs)
    why = {**{b: "INFLIGHT_CPU_ISA" for b in BUILDS[:start]}, **passed_over}
    not_used = "; ".join(f"{k}: {v}" for k, v in why.items())
    log.info("float GEMM: the %s build%s", isa, f" (not used: {not_used})" if not_used else "")
    return isa


def supports(weight: torch.Tensor) -> bool:
    """Whether the kernel takes this matrix: a 2-D CPU tensor of a TYPE_IDS dtype, K a multiple of 32."""
    return (weight.dim() == 2 and weight.device.type == "cpu" and weight.dtype in TYPE_IDS
            and weight.shape[1] % K_MULTIPLE == 0)


class CpuFloatWeight:
    """One float matrix [N, K], read in place by the C kernel."""

    def __init__(self, weight: torch.Tensor, isa: str | None = None):
        """``isa``: a build of BUILDS (tests, benches); default `chosen_isa()`."""
        if not supports(weight):
            raise ValueError(f"{NAME}: the weight must be a 2-D CPU tensor of float32, bfloat16 or float16 with "
                             f"K a multiple of {K_MULTIPLE}; got {weight.dtype} {tuple(weight.shape)} on {weight.device}")
        self.weight = weight.contiguous()  # the struct points into it: kept as long as this lives
        self.out_features, self.in_features = self.weight.shape
        self.isa = isa or chosen_isa()
        self._struct = _FWeight(self.weight.data_ptr(), TYPE_IDS[weight.dtype], self.out_features, self.in_features)
        self._gemm = cpu_build.function(NAME, "fgemm", (ctypes.POINTER(_FWeight), _P, _I, _P, _P, _I), self.isa)

    @property
    def dtype(self) -> torch.dtype:
        return self.weight.dtype

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, K] float32 -> x @ W.T + bias, [M, N] float32."""
        return cpu_quant.call_gemm(NAME, self._gemm, self._struct, x, bias, self.in_features, self.out_features)


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
              isa: str | None = None) -> torch.Tensor:
    """The kernel's result in torch (float32, another summation order): the activations rounded to
    bfloat16 first where build ``isa`` multiplies bfloat16 pairs."""
    if weight.dtype == torch.bfloat16 and (isa or chosen_isa()) in BF16_PAIRS:
        x = x.to(torch.bfloat16)
    out = x.double() @ weight.double().T
    return (out if bias is None else out + bias.double()).float()
