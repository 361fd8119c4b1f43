"""What a peer comparison ran on, printed above its figures and written into its JSON: the CPU model,
the instruction sets that decide both engines' kernels, the build of inflight's packed GEMM this
process picks (kernels/cpu/quant.py `chosen_isa`; the runners inherit its environment, so
INFLIGHT_CPU_ISA too), and the x86 options llama.cpp's build was configured with (`make
peers-llamacpp` passes LLAMACPP_ISA, derived from /proc/cpuinfo; cmake keeps them in the build's
CMakeCache.txt, read here so a build left from another machine or another LLAMACPP_ISA shows as it
is). The same model on AVX2-only and AVX-512 CPUs gives different ratios: a table without these is
not comparable.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Optional

from kernels import cpuinfo as kernels_cpuinfo

# the /proc/cpuinfo flags reported, those that choose kernels: AVX2 (+FMA, F16C), AVX-512 (F, BW,
# VNNI, BF16, FP16: oneDNN's float16 GEMM), AVX-VNNI on 256 bits, AMX
REPORTED_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "avx512_fp16",
                  "avx_vnni", "amx_tile", "amx_int8", "amx_bf16")
_GGML_OPTION = re.compile(r"^GGML_(NATIVE|SSE42|AVX\w*|FMA|F16C|BMI2|AMX_\w+):BOOL=(\w+)$", re.M)


def cpu_info(cpuinfo: Optional[Path] = None) -> tuple[str, set[str]]:
    """(model name, flags) of the first processor listed in a cpuinfo file (default: this machine's,
    kernels/cpuinfo.py); ("unknown", set()) where unreadable."""
    info = kernels_cpuinfo.this_cpu() if cpuinfo is None else kernels_cpuinfo.read(cpuinfo)
    if info is None:
        return "unknown", set()
    return info.model or "unknown", set(info.flags)


def inflight_quant_build() -> str:
    from kernels.cpu import build as cpu_build
    from kernels.cpu import quant as cpu_quant
    try:
        return cpu_quant.chosen_isa()
    except cpu_build.CpuKernelUnavailable as exc:
        return f"none ({str(exc).splitlines()[-1][:120]})"


def llamacpp_build_options(llama_server: Optional[Path]) -> Optional[dict[str, str]]:
    """The GGML x86 options in the CMakeCache.txt of the build holding ``llama_server`` (its bin/ is
    under the build folder); None where there is none."""
    if llama_server is None:
        return None
    cache = Path(llama_server).resolve().parent.parent / "CMakeCache.txt"
    try:
        return dict(_GGML_OPTION.findall(cache.read_text()))
    except OSError:
        return None


def machine_report(llama_server: Optional[Path], cpuinfo: Optional[Path] = None) -> dict:
    model, flags = cpu_info(cpuinfo)
    return {"cpu_model": model, "isa_flags": {f: f in flags for f in REPORTED_FLAGS},
            "inflight_quant_build": inflight_quant_build(),
            "llamacpp_build": llamacpp_build_options(llama_server)}


def build_text(options: Optional[dict[str, str]]) -> str:
    """A llama.cpp build's GGML x86 options (llamacpp_build_options) as KEY=VALUE words."""
    if options is None:
        return "no build found"
    return " ".join(f"{k}={v}" for k, v in options.items()) or "no GGML x86 options in its CMakeCache.txt"


def describe(report: dict) -> str:
    """Two lines for the top of the printed comparison."""
    flags = report["isa_flags"]
    listed = " ".join(f for f, on in flags.items() if on) or "none of " + " ".join(flags)
    missing = " ".join(f for f, on in flags.items() if not on)
    llama = build_text(report["llamacpp_build"])
    return (f"CPU: {report['cpu_model']}; lists {listed}{'; not ' + missing if missing and listed[:4] != 'none' else ''}\n"
            f"inflight's packed GEMM: the {report['inflight_quant_build']} build; llama.cpp built with {llama}")
