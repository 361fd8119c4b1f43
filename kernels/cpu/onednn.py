"""What oneDNN (torch's CPU GEMMs) runs on this machine, for the choices between it and our C
kernels: bfloat16 at all (backend/models/packed_linear.py widens the weight where it does not),
bfloat16 on AMX tiles (kernels/cpu/moe.py's expert panels, backend/models/float_linear.py's row
thresholds) and float16 on AVX512-FP16 (float_linear.py). Each honours ONEDNN_MAX_CPU_ISA, which
caps oneDNN's instructions as on a smaller CPU (the benches' forced AVX2 runs)."""
from __future__ import annotations

import os

import torch

from kernels.cpu import build as cpu_build


def max_isa_allows(*markers: str) -> bool:
    """Whether ONEDNN_MAX_CPU_ISA (unset: ALL) leaves oneDNN an ISA whose name holds one of
    `markers` (e.g. "AMX", "FP16": AVX512_CORE_AMX, AVX512_CORE_FP16)."""
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA", "ALL").upper()
    return cap == "ALL" or any(m in cap for m in markers)


def runs_bf16() -> bool:
    """Whether oneDNN runs bfloat16 GEMMs here: torch says the CPU can (AVX-512 BW/VL/DQ, or
    AVX-NE-CONVERT; an AVX2-only CPU cannot: the weight's reorder raises) and ONEDNN_MAX_CPU_ISA does
    not cap oneDNN below those (AVX512_CORE and up, AVX2_VNNI_2)."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()) and max_isa_allows("AVX512", "AVX10", "AMX",
                                                                                    "VNNI_2")


def runs_amx_bf16() -> bool:
    """Whether oneDNN's bfloat16 GEMMs run on AMX tiles here: the CPU lists amx_bf16, the kernel
    grants the tile state (torch's `_init_amx`), and ONEDNN_MAX_CPU_ISA does not cap it below."""
    if "amx_bf16" not in cpu_build._cpu_flags().split() or not max_isa_allows("AMX"):
        return False
    init = getattr(torch._C._cpu, "_init_amx", None)
    return bool(init and init())


def runs_fp16() -> bool:
    """Whether oneDNN runs float16 GEMMs here: torch says the CPU can (avx512_fp16 or
    avx_ne_convert) and ONEDNN_MAX_CPU_ISA does not cap oneDNN below AVX512-FP16 (AMX-FP16 is above it)."""
    return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported()) and max_isa_allows("FP16", "AMX")
