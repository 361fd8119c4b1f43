"""Static SASS statistics of the quantized GEMMs, compiled for a GPU that is not here: how many
instructions and how many global loads (LDG) each compiled variant holds, for sessions with no GPU.

    python -m client.tools.benchmarks.sass_stats [--target sm_90] [--kernel gguf_gemm_kernel] [--json FILE]

The variants are kernels.aot's (kernels/gpu/quant_dispatch.py `aot_launches`, a Llama-3-8B qkv
projection, bf16: each tile regime), compiled with the triton wheel's compiler and disassembled with
its cuobjdump. Static counts are a proxy, not a timing: a load in a loop counts once. They show what
a change does to the instruction stream (e.g. per-lane scale gathers replaced by one load a group)
before a GPU can time it.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import tempfile
from typing import Optional

import torch

INSTRUCTION = re.compile(r"\s+/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)")   # (a predicate skipped)
QTYPE_NAMES = {0: "Q4_0", 1: "Q4_1", 2: "Q5_0", 3: "Q5_1", 4: "Q4_K", 5: "Q5_K", 6: "Q6_K"}


def sass_counts(sass: str) -> dict:
    """Instructions and global loads in cuobjdump's SASS listing."""
    ops = [m.group(1) for m in map(INSTRUCTION.match, sass.splitlines()) if m]
    return dict(instructions=len(ops), global_loads=sum(o.startswith("LDG") for o in ops))


def stats(kernel: str = "gguf_gemm_kernel", target: str = "sm_90", limit: Optional[int] = None) -> list[dict]:
    """(Compiles: the kernels must be real @triton.jit functions, so a process without
    TRITON_INTERPRET=1; importing this module changes nothing, so tests may import sass_counts.)"""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("sass_stats compiles kernels: run it in a process without TRITON_INTERPRET=1")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile as triton_compile

    from kernels.aot import TARGETS, specialize
    from kernels.gpu.quant_dispatch import aot_launches

    arch = TARGETS[target][0]
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    seen, rows = set(), []
    for launch in aot_launches({"qkv": (6144, 4096, False)}, torch.bfloat16):
        if launch.name != kernel or arch < launch.min_arch:
            continue
        signature, constexprs, attrs, options = specialize(launch, arch)
        key = repr((sorted(constexprs.items()), sorted(options.items())))
        if key in seen:
            continue
        seen.add(key)
        compiled = triton_compile(ASTSource(launch.kernel, signature, constexprs, attrs),
                                  target=GPUTarget("cuda", arch, 32), options=options)
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "k.cubin")
            with open(path, "wb") as f:
                f.write(compiled.asm["cubin"])
            sass = subprocess.run([cuobjdump, "-sass", path], capture_output=True, text=True, check=True).stdout
        c = launch.constexprs
        rows.append(dict(kernel=kernel, target=target, qtype=QTYPE_NAMES.get(c.get("QTYPE"), c.get("QTYPE")),
                         block_m=c.get("BLOCK_M"), block_k=c.get("BLOCK_K"), shared_bytes=int(compiled.metadata.shared),
                         **sass_counts(sass)))
        if limit and len(rows) >= limit:
            break
    return rows


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m client.tools.benchmarks.sass_stats", description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="sm_90", choices=("sm_80", "sm_90"))
    ap.add_argument("--kernel", default="gguf_gemm_kernel", choices=("gguf_gemm_kernel", "w8_gemm_kernel", "awq_gemm_kernel"))
    ap.add_argument("--limit", type=int, help="the first N variants only")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    rows = stats(args.kernel, args.target, args.limit)
    print("| qtype | M tile | K tile | instructions | global loads | shared bytes |\n| --- | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['qtype']} | {r['block_m']} | {r['block_k']} | {r['instructions']} | {r['global_loads']} | {r['shared_bytes']} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
