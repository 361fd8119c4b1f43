"""Build the CPU kernels in kernels/cpu/csrc/ with the machine's C compiler, once, and load them.

They are compiled where they run, for that CPU (-march=native), into a cache keyed by the source,
the flags, the compiler and the CPU's feature flags, so a second process (or a second run) loads
the library in milliseconds. No torch headers, no Python API: plain C functions over raw pointers,
called through ctypes by their wrappers.

OpenMP: the library names libgomp.so.1, the soname torch already loaded, so the dynamic loader
hands it torch's copy and the kernels run in the same thread team as torch's own ops (one runtime,
no second pool of spinning threads).

-ffast-math is given when compiling only: it lets the float reductions vectorize, and with gnu11
(not strict c11) glibc's math.h declares its vector expf (libmvec), so exp loops run 16 lanes
wide. The kernels never feed it inf or NaN (softmax subtracts the row's max first). It is left off
the link, since linking with it would add crtfastmath.o, which turns on flush-to-zero for the
whole process.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Callable, Mapping, Optional, Sequence

from kernels import cpuinfo

log = logging.getLogger(__name__)
CSRC = Path(__file__).resolve().parent / "csrc"
BASE_FLAGS = ["-O3", "-ffast-math", "-fopenmp", "-fPIC", "-std=gnu11", "-Wall", "-Werror"]
COMPILE_FLAGS = BASE_FLAGS[:1] + ["-march=native"] + BASE_FLAGS[1:]
LINK_FLAGS = ["-shared", "-fopenmp", "-lm"]
# Builds for a named instruction set instead of -march=native, for kernels that are picked at run
# time by what the CPU really runs (`first_that_runs`: quant.py's and float_gemm.py's): a VM may list
# flags (AMX, say) whose instructions it kills the process for, so no build may assume more than its own set.
ISA_FLAGS = {
    "avx512_vnni": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni", "-mf16c",
                    "-mfma", "-DQUANT_AVX512"],
    # The AVX512-VNNI build with AMX's int8 tiles for the rows of a GEMM where they pay
    # (quant_gemm_amx.h amx_takes, amx_tail)
    "amx_int8": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni", "-mf16c",
                 "-mfma", "-mamx-tile", "-mamx-int8", "-DQUANT_AVX512", "-DQUANT_AMX"],
    "avx_vnni": ["-mavx2", "-mfma", "-mf16c", "-mavxvnni", "-DQUANT_AVX2", "-DQUANT_AVXVNNI"],  # 256-bit VNNI
    "avx2": ["-mavx2", "-mfma", "-mf16c", "-DQUANT_AVX2"],  # AVX2 intrinsics (AMD Zen 1-3, most laptops)
    # The portable C code vectorized by the compiler for AVX2: what the avx2 build was before its
    # intrinsics. Never chosen at run time; benches time it (client/tools/benchmarks/cpu_quant.py).
    "avx2_autovec": ["-mavx2", "-mfma", "-mf16c"],
    "portable": [],  # the compiler's baseline for the machine (x86-64: SSE2)
    # float_gemm.c's (kernels/cpu/float_gemm.py): AVX-512 with vdpbf16ps for bfloat16 weights, and without
    "avx512_bf16": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mf16c", "-mfma"],
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mf16c", "-mfma"],
    # prefill_attention.c's for bfloat16 caches on AMX's bfloat16 tiles (prefill_attention_amx.h)
    "amx_bf16": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mf16c", "-mfma",
                 "-mamx-tile", "-mamx-bf16", "-DPREFILL_AMX"],
}

# What -march=native may not use where INFLIGHT_CPU_ISA (kernels/cpu/quant.py BUILDS) names a
# smaller instruction set than the CPU's: the -march=native libraries (attention, the layer stack,
# the elementwise ops, the grouped experts) then play that CPU too, not only the GEMMs, so an
# "AVX2 build forced" figure is what an AVX2-only CPU would get (`native_flags`). INFLIGHT_NATIVE_ISA
# sets this cap alone ("native": none), over INFLIGHT_CPU_ISA's
_NO_AMX = ["-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16"]
NATIVE_CAPS = {
    "native": [],
    "amx_int8": [],
    "avx512_vnni": ["-mno-avx512bf16", "-mno-avx512fp16", *_NO_AMX],
    "avx_vnni": ["-mno-avx512f", *_NO_AMX],
    "avx2": ["-mno-avx512f", "-mno-avxvnni", *_NO_AMX],
    "portable": ["-mno-avx", *_NO_AMX],  # SSE only: no AVX, AVX2, FMA, F16C or AVX-512
}

# A library's own flags after those: float_gemm.c's outputs must not depend on the block of rows they
# fall in (the C layer stack and the Python layers then agree bit for bit), so the compiler may not
# reassociate its sums (the portable build's did, per block shape)
SOURCE_FLAGS = {"float_gemm": ["-fno-associative-math"]}


class CpuKernelUnavailable(RuntimeError):
    """No C compiler, or the build failed: the caller uses the torch reference instead."""


def cache_dir() -> Path:
    """INFLIGHT_CACHE_DIR, else ~/.cache/inflight; a temporary folder when that cannot be made (a
    container run with --user and no writable home)."""
    root = os.environ.get("INFLIGHT_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "inflight")
    path = Path(root) / "cpu_kernels"
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError:
        path = Path(tempfile.gettempdir()) / f"inflight-cpu-kernels-{os.getuid()}"
        path.mkdir(parents=True, exist_ok=True)
    return path


def _cpu_flags() -> str:
    """The CPU's feature flags, space-separated (kernels/cpuinfo.py), in every library's cache key
    and read by the kernels that choose a build (tests patch it to play another CPU); where none
    are listed, platform.processor()."""
    flags = cpuinfo.cpu_flags()
    return " ".join(sorted(flags)) if flags else platform.processor()


def forced_build(var: str, builds: Sequence[str]) -> Optional[str]:
    """The build the environment variable `var` forces, or None where it is unset or empty; a value
    that is none of `builds` is refused by name."""
    forced = os.environ.get(var)
    if forced and forced not in builds:
        raise ValueError(f"{var}={forced!r}; one of {', '.join(builds)}")
    return forced or None


def first_that_runs(builds: Sequence[str], needs: Mapping[str, Sequence[str]],
                    probe: Callable[[str], tuple[bool, str]]) -> tuple[str, dict[str, str]]:
    """The build of a kernel this CPU runs, and why each better one was passed over: the first of
    `builds` (best first) whose /proc/cpuinfo flags `needs[build]` the CPU lists and whose library
    `probe(build)` -> (ran, why not) ran and got the right answer in a child process; else the
    last, the portable one, never probed. One choice for every kernel built per instruction set
    (quant.py's and float_gemm.py's `chosen_isa`), so they read the flags and pass over a build alike."""
    flags = set(_cpu_flags().split())
    passed_over: dict[str, str] = {}
    for isa in builds[:-1]:
        missing = [f for f in needs[isa] if f not in flags]
        if missing:
            passed_over[isa] = f"the CPU does not list {', '.join(missing)}"
            continue
        ran, why_not = probe(isa)
        if ran:
            return isa, passed_over
        passed_over[isa] = why_not
    return builds[-1], passed_over


def native_flags() -> list[str]:
    """The flags of a -march=native library: COMPILE_FLAGS, capped (NATIVE_CAPS) by INFLIGHT_NATIVE_ISA
    where it is set, else by INFLIGHT_CPU_ISA."""
    cap = forced_build("INFLIGHT_NATIVE_ISA", tuple(NATIVE_CAPS)) or forced_build("INFLIGHT_CPU_ISA", tuple(NATIVE_CAPS))
    return COMPILE_FLAGS + NATIVE_CAPS[cap or "native"]


def _compiler() -> Optional[str]:
    chosen = os.environ.get("CC")
    return shutil.which(chosen) if chosen else shutil.which("gcc") or shutil.which("cc")


@functools.lru_cache(maxsize=None)
def _compiler_version(cc: str) -> str:
    """First line of `cc --version`: part of every library's cache key (one run per process)."""
    return subprocess.run([cc, "--version"], capture_output=True, text=True).stdout.split("\n")[0]


def _run(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise CpuKernelUnavailable(f"{' '.join(cmd)} failed:\n{proc.stderr.strip()[-2000:]}")


def build(name: str, isa: Optional[str] = None) -> Path:
    """Compile kernels/cpu/csrc/<name>.c into the cache (if not there yet); the library's path. With
    ``isa`` (a key of ISA_FLAGS) it is built for that instruction set, not -march=native (capped by
    INFLIGHT_CPU_ISA: `native_flags`)."""
    cc = _compiler()
    if cc is None:
        raise CpuKernelUnavailable(f"no C compiler: CC={os.environ.get('CC')!r} is not runnable"
                                   if os.environ.get("CC") else "no C compiler (gcc or cc) on PATH; set CC")
    try:
        source = (CSRC / f"{name}.c").read_bytes()
    except OSError as e:  # an install that left the C sources out
        raise CpuKernelUnavailable(f"no source for CPU kernel '{name}': {e}") from e
    flags = (native_flags() if isa is None else BASE_FLAGS + ISA_FLAGS[isa]) + SOURCE_FLAGS.get(name, [])
    headers = [h.read_bytes() for h in sorted(CSRC.glob("*.h"))]  # what the sources #include
    key = hashlib.sha256(b"\0".join([source, *headers, " ".join(flags + LINK_FLAGS).encode(),
                                     _compiler_version(cc).encode(), _cpu_flags().encode()])).hexdigest()[:16]
    stem = name if isa is None else f"{name}-{isa}"
    target = cache_dir() / f"{stem}-{key}.so"
    if target.exists():
        return target
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:  # concurrent builders never clash
        obj, lib = Path(tmp) / f"{name}.o", Path(tmp) / f"{name}.so"
        _run([cc, *flags, "-c", str(CSRC / f"{name}.c"), "-o", str(obj)])
        _run([cc, str(obj), "-o", str(lib), *LINK_FLAGS])
        os.replace(lib, target)  # atomic: a reader sees no library or a whole one
    log.info("built CPU kernel %s -> %s", stem, target)
    return target


@functools.lru_cache(maxsize=None)
def function(library: str, name: str, argtypes: tuple, isa: Optional[str] = None,
             restype=None) -> ctypes._CFuncPtr:
    """One C function of a kernel library, bound once with its argument and result types (the
    wrappers call it every layer of every step: binding it per call cost more than a small kernel)."""
    fn = getattr(load(library, isa), name)
    fn.restype, fn.argtypes = restype, list(argtypes)
    return fn


def address(fn) -> int:
    """A C function's address (a library's function, or a ctypes callback), as the structs of
    function pointers the kernels call through (decode_stack.c's ops, moe_block.c's experts) hold it."""
    return ctypes.cast(fn, ctypes.c_void_p).value


@functools.lru_cache(maxsize=None)
def load(name: str, isa: Optional[str] = None) -> ctypes.CDLL:
    """The compiled library (built on first use). torch is imported first, so that libgomp.so.1
    resolves to torch's copy."""
    import torch  # noqa: F401  (see above)
    return ctypes.CDLL(str(build(name, isa)))
