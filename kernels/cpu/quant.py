"""GEMMs on packed quantized weights on the CPU (kernels/cpu/csrc/quant_gemm.c), and the choice of
its build for this CPU.

`CpuQuantWeight(qtype, parts)` re-lays a packed matrix (docs/quantization.md) once, at load, into
the kernel's tiles of 16 rows (`tile_layout`: the same bytes in another order, not dequantized),
then `matmul(x, bias)` is one C call per projection and `rows(ids)` dequantizes a few rows (the
quantized embedding). Their oracles are kernels/quant_reference.py `qmatmul` and `dequantize`.

Which build runs (`chosen_isa`): the AMX one (the AVX512-VNNI kernel, with AMX's int8 tiles for 12
rows or more: quant_gemm_amx.h) where /proc/cpuinfo lists amx_tile and amx_int8 too AND its probe
ran them in a child process, else the AVX512-VNNI one where /proc/cpuinfo lists avx512f, avx512bw
and avx512_vnni AND a child process ran it and got the right answer (some hypervisors list
instructions they then kill a process for: docs/design.md, llama.cpp's AMX), else the AVX-VNNI
one (256-bit vpdpbusd) and the AVX2 one (maddubs; both quant_gemm_avx2.h) on the same two
conditions, else the portable C build, with one log line saying why (kernels/cpu/build.py
`first_that_runs`, float_gemm.py's choice too). `INFLIGHT_CPU_ISA=avx2` (or any of BUILDS) forces a build.
"""
from __future__ import annotations

import ctypes
import functools
import logging
import subprocess
import sys
from typing import Mapping, Sequence

import torch

from kernels import checks as _common

from kernels.cpu import build as cpu_build
from kernels.cpu import huge_pages
from kernels.quant_reference import ARRAYS, QK, QK_K

log = logging.getLogger(__name__)
TILE = 16
TYPE_IDS = {"Q8_0": 0, "Q4_0": 1, "Q4_1": 2, "Q5_0": 3, "Q5_1": 4, "Q4_K": 5, "Q5_K": 6, "Q6_K": 7}
VNNI_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_vnni", "f16c")
AVX2_FLAGS = ("avx2", "fma", "f16c")
AVX_VNNI_FLAGS = AVX2_FLAGS + ("avx_vnni",)
AMX_FLAGS = VNNI_FLAGS + ("amx_tile", "amx_int8")
BUILDS = ("amx_int8", "avx512_vnni", "avx_vnni", "avx2", "portable")  # best first (kernels/cpu/build.py ISA_FLAGS)
NEEDS = {"amx_int8": AMX_FLAGS, "avx512_vnni": VNNI_FLAGS, "avx_vnni": AVX_VNNI_FLAGS,
         "avx2": AVX2_FLAGS}  # /proc/cpuinfo flags
NAME = "quant_gemm"
_P, _I = ctypes.c_void_p, ctypes.c_int64


class _QWeight(ctypes.Structure):  # qweight_t in quant_gemm.c
    _fields_ = [("qs", _P), ("qh", _P), ("scales", _P), ("mins", _P), ("sub_scales", _P),
                ("sub_mins", _P), ("type", _I), ("N", _I), ("K", _I)]


# -- which build ----------------------------------------------------------------------------------
def _probe_expected() -> float:
    """What quant_gemm.c's `probe` must return: a Q4_0 tile-group, byte i = 7 i mod 256, scales 1,
    activations ((i % 5) - 2) * 50 with the last 127 (their codes exact), summed over the 16 rows."""
    x = [((i % 5) - 2) * 50 for i in range(QK)]
    x[-1] = 127
    total = 0
    for i in range(256):
        byte, c, b = (7 * i) % 256, i // 64, i % 4  # byte (c, lane, b) of the tile
        total += ((byte & 15) - 8) * x[4 * c + b] + ((byte >> 4) - 8) * x[16 + 4 * c + b]
    return float(total)


def probe_library(path, expected: float | None = None) -> tuple[bool, str]:
    """Run a build's `probe` in a child process: a CPU (or VM) that kills it for an illegal
    instruction kills the child, not the engine. (True, "") when it ran and computed the sum
    (``expected``, default this kernel's; kernels/cpu/float_gemm.py passes its own)."""
    code = ("import ctypes,sys; lib = ctypes.CDLL(sys.argv[1]); lib.probe.restype = ctypes.c_float; "
            "print(lib.probe())")
    try:
        done = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        return False, "its probe did not finish in 60 s"
    if done.returncode != 0:
        return False, f"its probe died (exit status {done.returncode}: {done.stderr.strip()[-200:]})"
    try:
        got = float(done.stdout.strip())
    except ValueError:
        return False, f"its probe printed {done.stdout.strip()[:80]!r}"
    expected = _probe_expected() if expected is None else expected
    if got != expected:
        return False, f"its probe computed {got}, not {expected}"
    return True, ""


def _probe_runs(isa: str) -> tuple[bool, str]:
    try:
        path = cpu_build.build(NAME, isa)
    except cpu_build.CpuKernelUnavailable as e:  # an older gcc without -mavxvnni, say: the next build
        return False, f"it did not compile ({str(e).splitlines()[-1][:200]})"
    return probe_library(path)


@functools.lru_cache(maxsize=None)
def chosen_isa() -> str:
    """The build of quant_gemm.c this process uses: "amx_int8" (AVX512-VNNI, and AMX tiles for a
    GEMM's whole blocks of 16 rows where they pay), else "avx512_vnni" (intrinsics), else "avx_vnni"
    (the same dot product on 256 bits), else "avx2" (maddubs/madd in place of vpdpbusd), else
    "portable" (plain C for the compiler's baseline)."""
    forced = cpu_build.forced_build("INFLIGHT_CPU_ISA", BUILDS)
    if forced:
        log.info("quantized GEMM: the %s build (INFLIGHT_CPU_ISA)", forced)
        return forced
    isa, why = cpu_build.first_that_runs(BUILDS, NEEDS, _probe_runs)
    not_used = "; ".join(f"{k}: {v}" for k, v in why.items())
    if isa in ("avx_vnni", "avx2"):  # 1.4-1.7x the AVX-512 one's time for one row, 2-3x for many
        log.info("quantized GEMM: the %s build (not used: %s)", isa, not_used)
    elif isa == "portable":
        log.warning("quantized GEMM: falling back to the portable C kernel, several times slower than the "
                    "AVX2 and AVX512-VNNI ones and than float32 GEMMs (quantization=auto measures both at load "
                    "and may dequantize: backend/models/cpu_weight_choice.py); not used: %s", not_used)
    return isa


# -- the weight, re-laid in tiles -----------------------------------------------------------------
def _tiles(t: torch.Tensor, rows: int) -> torch.Tensor:
    """[N, ...] padded with zero rows to whole tiles of 16: [T, 16, ...]."""
    pad = (-t.shape[0]) % TILE
    if pad:
        t = torch.cat([t, t.new_zeros((pad,) + tuple(t.shape[1:]))])
    return t.view(-1, TILE, *t.shape[1:])


def _lane_bits(planes: torch.Tensor, count: int) -> torch.Tensor:
    """qhigh [N, G * 4 * count] (bit i of a plane = value i) -> per tile, group and lane the
    kernel's words: bit (8 b + c) of word w holds the high bit(s) of value v(c, b), where quad c < 4
    is values 4c..4c+3 and c >= 4 values 16+4(c-4)..; Q6_K's two bits sit at 8 b + 2 j (+1) of word
    w for quad c = 4 w + j. Returns uint8 [T, G, words, 16, 4]."""
    n, groups = planes.shape[0], planes.shape[1] // (4 * count)
    shifts = torch.arange(8, dtype=torch.uint8)
    bits = ((planes.view(n, groups, count, 4, 1) >> shifts) & 1).view(n, groups, count, QK)
    value = torch.tensor([[4 * c + b if c < 4 else 16 + 4 * (c - 4) + b for c in range(8)] for b in range(4)])
    if count == 1:  # word bit 8 b + c
        word = bits[:, :, 0][:, :, value.reshape(-1)].view(n, groups, 1, 4, 8)  # [n, g, 1, b, c]
    else:  # word w, bit 8 b + 2 j + k: plane k of value v(4 w + j, b)
        v = value.view(4, 2, 4)  # [b, w, j]
        picked = bits[:, :, :, v.reshape(-1)].view(n, groups, 2, 4, 2, 4)  # [n, g, k, b, w, j]
        word = picked.permute(0, 1, 4, 3, 5, 2).reshape(n, groups, 2, 4, 8)  # [n, g, w, b, (j, k)]
    weights = (word.to(torch.int32) << torch.arange(8, dtype=torch.int32)).sum(-1).to(torch.uint8)
    return _tiles(weights, n).permute(0, 2, 3, 1, 4).contiguous()  # [T, G, words, 16, 4]


def tile_layout(qtype: str, parts: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The packed arrays of one matrix in quant_gemm.c's tiles (its header comment)."""
    qw = parts["qweight"]
    n = qw.shape[0]
    out: dict[str, torch.Tensor] = {}
    if qtype == "Q8_0":  # [T, 16, G, 8, 4] -> [T, G, 8, 16, 4], + 128: unsigned for vpdpbusd
        codes = (qw.to(torch.int16) + 128).to(torch.uint8)
        out["qs"] = _tiles(codes.view(n, -1, 8, 4), n).permute(0, 2, 3, 1, 4).contiguous()
    else:  # byte 4 c + b of a group -> chunk c, lane, b
        out["qs"] = _tiles(qw.view(n, -1, 4, 4), n).permute(0, 2, 3, 1, 4).contiguous()
    if "qhigh" in parts:
        out["qh"] = _lane_bits(parts["qhigh"], 2 if qtype == "Q6_K" else 1)
    for name in ("scales", "mins", "sub_mins"):
        if name in parts:
            out[name] = _tiles(parts[name], n).permute(0, 2, 1).contiguous()  # [T, groups, 16]
    if "sub_scales" in parts:
        sub = parts["sub_scales"]
        if qtype == "Q6_K":  # [N, 2G] -> [T, G, 2, 16]
            out["sub_scales"] = _tiles(sub.view(n, -1, 2), n).permute(0, 2, 3, 1).contiguous()
        else:
            out["sub_scales"] = _tiles(sub, n).permute(0, 2, 1).contiguous()
    return out


class CpuQuantWeight:
    """One packed matrix [N, K] in the kernel's layout, with its C calls."""

    def __init__(self, qtype: str, parts: Mapping[str, torch.Tensor], isa: str | None = None):
        """``isa``: a build of kernels/cpu/build.py ISA_FLAGS (tests, benches); default `chosen_isa()`."""
        if qtype not in TYPE_IDS:
            raise ValueError(f"{NAME}: no CPU kernel for {qtype!r}; types: {', '.join(TYPE_IDS)}")
        missing = set(ARRAYS[qtype]) - set(parts)
        if missing:
            raise ValueError(f"{NAME}: a {qtype} matrix needs {', '.join(sorted(missing))}")
        self.qtype = qtype
        self.out_features = parts["qweight"].shape[0]
        self.in_features = parts["qweight"].shape[1] * (1 if qtype == "Q8_0" else 2)
        block = QK_K if qtype in ("Q4_K", "Q5_K", "Q6_K") else QK
        if self.in_features % block:
            raise ValueError(f"{NAME}: {qtype} rows of {self.in_features} values are not whole blocks of {block}")
        self.isa = isa or chosen_isa()
        tiles = tile_layout(qtype, {k: v.contiguous() for k, v in parts.items()})
        self.tiles = {k: huge_pages.place(v) for k, v in tiles.items()}  # streamed every step: 2 MB pages
        ptr = lambda name: self.tiles[name].data_ptr() if name in self.tiles else None  # noqa: E731
        self._struct = _QWeight(ptr("qs"), ptr("qh"), ptr("scales"), ptr("mins"), ptr("sub_scales"),
                                ptr("sub_mins"), TYPE_IDS[qtype], self.out_features, self.in_features)
        self._gemm = cpu_build.function(NAME, "qgemm", (ctypes.POINTER(_QWeight), _P, _I, _P, _P, _I), self.isa)
        self._rows = cpu_build.function(NAME, "dequant_rows", (ctypes.POINTER(_QWeight), _P, _I, _P), self.isa)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tiles.values())

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, K] float32 -> x @ W.T + bias, [M, N] float32."""
        return call_gemm(NAME, self._gemm, self._struct, x, bias, self.in_features, self.out_features)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` [R] of W, dequantized: [R, K] float32."""
        ids = ids.to(torch.int64).contiguous()
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.out_features):
            raise ValueError(f"{NAME}: row ids must be in [0, {self.out_features}); got "
                             f"{int(ids.min())}..{int(ids.max())}")
        out = torch.empty(ids.numel(), self.in_features, dtype=torch.float32)
        if ids.numel():
            self._rows(ctypes.byref(self._struct), ids.data_ptr(), ids.numel(), out.data_ptr())
        return out


class CpuQuantExperts:
    """A mixture-of-experts layer's packed expert matrices (one projection: every expert's gate/up,
    or every down), all of one type and shape, multiplied in one C call (`qgemm_experts`): the
    activations quantized once, every active expert's tiles in one parallel loop. Each row's
    result equals `CpuQuantWeight.matmul` on that row (the same tile code); kernels/cpu/moe.py
    `sorted_moe` calls it."""

    def __init__(self, weights: Sequence[CpuQuantWeight]):
        first = weights[0]
        shape = (first.qtype, first.out_features, first.in_features, first.isa)
        for e, w in enumerate(weights):
            if (w.qtype, w.out_features, w.in_features, w.isa) != shape:
                raise ValueError(f"{NAME}: expert {e} is {w.qtype} [{w.out_features}, {w.in_features}] "
                                 f"({w.isa}); expert 0 is {shape[0]} [{shape[1]}, {shape[2]}] ({shape[3]})")
        self.weights = list(weights)   # their tiles must outlive the structs below
        self.out_features, self.in_features = first.out_features, first.in_features
        self._structs = (_QWeight * len(weights))(*(w._struct for w in weights))
        self._gemm = cpu_build.function(NAME, "qgemm_experts", (_P, _I, _P, _P, _P, _I), first.isa)

    def matmul(self, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """x [R, K] float32, rows sorted by expert; offsets int64 [E + 1] (expert e's rows:
        offsets[e] .. offsets[e + 1] - 1, from 0 to R) -> [R, N] float32."""
        experts = len(self.weights)
        if x.dtype != torch.float32 or x.is_cuda or x.dim() != 2 or x.shape[1] != self.in_features:
            raise ValueError(f"{NAME}: x must be a float32 CPU tensor [R, {self.in_features}]; got "
                             f"{x.dtype} {tuple(x.shape)} on {x.device}")
        if offsets.dtype != torch.int64 or tuple(offsets.shape) != (experts + 1,):
            raise ValueError(f"{NAME}: offsets must be int64 [{experts + 1}]; got {offsets.dtype} {tuple(offsets.shape)}")
        bounds = offsets.tolist()
        if bounds[0] != 0 or bounds[-1] != x.shape[0] or any(a > b for a, b in zip(bounds, bounds[1:])):
            raise ValueError(f"{NAME}: offsets must rise from 0 to the {x.shape[0]} rows of x; got {bounds}")
        x, offsets = x.contiguous(), offsets.contiguous()
        out = _common.alloc((x.shape[0], self.out_features), torch.float32, x.device)
        if x.shape[0]:
            self._gemm(ctypes.addressof(self._structs), experts, x.data_ptr(), offsets.data_ptr(),
                       out.data_ptr(), self.out_features)
        return out


def call_gemm(name: str, gemm, struct, x: torch.Tensor, bias: torch.Tensor | None, in_features: int,
              out_features: int) -> torch.Tensor:
    """A C GEMM's call (quant_gemm.c's qgemm, float_gemm.c's fgemm: out = x @ W^T + bias), its
    arguments checked: x [M, in_features] float32 on the CPU, bias float32 [out_features] or None."""
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 2 or x.shape[1] != in_features:
        raise ValueError(f"{name}: x must be a float32 CPU tensor [M, {in_features}]; got "
                         f"{x.dtype} {tuple(x.shape)} on {x.device}")
    if bias is not None and (bias.dtype != torch.float32 or tuple(bias.shape) != (out_features,)):
        raise ValueError(f"{name}: bias must be float32 [{out_features}]; got {bias.dtype} {tuple(bias.shape)}")
    x = x.contiguous()
    out = torch.empty(x.shape[0], out_features, dtype=torch.float32)
    if x.shape[0]:
        gemm(ctypes.byref(struct), x.data_ptr(), x.shape[0], None if bias is None else bias.contiguous().data_ptr(),
             out.data_ptr(), out_features)
    return out
