"""The AMX build of the quantized GEMM (kernels/cpu/csrc/quant_gemm_amx.h) against the AVX512-VNNI
build it extends: for 16 rows or more it makes the same integer dot products with AMX's int8 tiles
and scales them with the same float operations in the same order, so every output must equal the
VNNI build's bit for bit (both are checked against the torch reference in test_cpu_quant.py). Runs
where this CPU lists AMX and the build's probe ran in a child process (test_cpu_quant.amx_runs: a
VM may list AMX and refuse or kill it); elsewhere there is no AMX to test."""
import ctypes

import pytest
import torch

from kernels.cpu import build as cpu_build
from kernels.cpu import quant as cpu_quant
from test_cpu_quant import TYPES, amx_runs, packed

from backend.models.gguf.packed import BLOCK_SIZES, TYPE_IDS


pytestmark = pytest.mark.skipif(not amx_runs(), reason="this CPU does not run the AMX build")


# Per row count: (took the tiles, rows of the tail the VNNI kernel took beside them) (quant_gemm_amx.h
# amx_takes, amx_tail): whole blocks of 16 on the tiles, a short tail beside them and a nearly whole
# one padded (the VNNI kernel pays by the row, the tiles by the block); Q6_K from 4 blocks.
TOOK_TILES = {
    "4/5-bit": {11: (0, 0), 12: (0, 0), 15: (1, 0), 16: (1, 0), 17: (1, 1), 21: (1, 5), 22: (1, 0), 31: (1, 0),
                33: (1, 1), 40: (1, 0), 260: (1, 4), 275: (1, 3), 300: (1, 0)},
    "Q8_0": {11: (0, 0), 15: (0, 0), 16: (1, 0), 17: (1, 1), 24: (1, 8), 25: (1, 0), 31: (1, 0), 33: (1, 1),
             40: (1, 8), 260: (1, 4), 275: (1, 3), 300: (1, 0)},
    "Q6_K": {15: (0, 0), 16: (0, 0), 33: (0, 0), 63: (0, 0), 64: (1, 0), 65: (1, 0), 260: (1, 0), 300: (1, 0)},
}


def amx_calls() -> int:
    return cpu_build.function(cpu_quant.NAME, "amx_calls", (), "amx_int8", restype=ctypes.c_int64)()


def amx_tail_rows() -> int:
    return cpu_build.function(cpu_quant.NAME, "amx_tail_rows", (), "amx_int8", restype=ctypes.c_int64)()


@pytest.mark.parametrize("qtype", TYPES)
def test_every_row_count_equals_the_vnni_build_bit_for_bit(qtype):
    per_block = BLOCK_SIZES[TYPE_IDS[qtype]][0]
    took = TOOK_TILES[qtype if qtype in ("Q8_0", "Q6_K") else "4/5-bit"]
    gen = torch.Generator().manual_seed(11)
    # blocks: 5 and 6 groups of 32 (odd and even: the tiles alternate two sets a group); 37 output
    # rows: two whole tiles and a partial one
    for n, blocks in ((37, 2), (37, 3)) if per_block == 256 else ((37, 5), (21, 6)):
        parts = packed(qtype, n, blocks, seed=len(qtype) + n + blocks)
        amx = cpu_quant.CpuQuantWeight(qtype, parts, isa="amx_int8")
        vnni = cpu_quant.CpuQuantWeight(qtype, parts, isa="avx512_vnni")
        bias = torch.randn(n, generator=gen)
        # 11, 12, 15: one padded block; 16: a whole one; 17-40: a block or two and the next's rows,
        # padded or the tail; 260, 275, 300: past one pass of 256 rows, ending part way (the tail in
        # the second pass, or 275's a pass of its own of one block)
        for m, expected in took.items():
            x = torch.randn(m, blocks * per_block, generator=gen)
            x[0, :5] = 40.0  # an outlier: one group's scale
            x[-1] = 0.0  # a row of zeros: its groups' scales are 0
            before, tail_before = amx_calls(), amx_tail_rows()
            got = amx.matmul(x, bias)
            ran = (amx_calls() - before, amx_tail_rows() - tail_before)
            assert torch.equal(got, vnni.matmul(x, bias)), (qtype, n, blocks, m)
            # the tiles ran, and left the tail to the VNNI kernel, where amx_takes and amx_tail say
            # they pay (their tables, from measurements)
            assert ran == expected, (qtype, m, ran)


def test_the_probe_runs_the_tiles_here():
    assert cpu_quant._probe_runs("amx_int8") == (True, "")
    assert cpu_quant.chosen_isa() == "amx_int8" or cpu_build.forced_build("INFLIGHT_CPU_ISA", cpu_quant.BUILDS)
