"""The quantized GEMM on the CPU (kernels/cpu/csrc/quant_gemm.c) against its torch reference
(kernels/quant_reference.py `qmatmul`: activations quantized per group of 32, exact integer dot
products, then scaled), for every packed type, in both builds (AVX512-VNNI where this CPU runs it,
and the portable C one); and the choice of build, which must fall back, saying why, when the CPU
lacks the instructions or a probe of them dies."""
import functools
import logging
import shutil
import subprocess

import pytest
import torch

from backend.models.gguf.packed import BLOCK_SIZES, PACKED_TYPES, TYPE_IDS, pack
from kernels.cpu import build as cpu_build
from kernels.cpu import quant as cpu_quant
from kernels.quant_reference import dequantize, qmatmul
from test_quant_layout import random_blocks

TYPES = sorted(PACKED_TYPES.values())


def packed(qtype: str, n: int, blocks: int, seed: int) -> dict[str, torch.Tensor]:
    raw = random_blocks(qtype, n, blocks, seed)
    k = blocks * BLOCK_SIZES[TYPE_IDS[qtype]][0]
    return {a: torch.from_numpy(v) for a, v in pack(raw, TYPE_IDS[qtype], (n, k)).items()}


@functools.lru_cache(maxsize=None)  # asked at collection here and by test_cpu_quant_amx.py: one child probe
def amx_runs() -> bool:
    """This CPU lists AMX and the build's probe was not refused the tiles (returned NaN: the kernel
    refused the tile state) nor killed for running them (SIGILL, exit status -4). A probe that computed
    a wrong sum or crashed otherwise, or a build that does not compile, counts as running, so that the
    tests fail rather than skip (the engine would fall back)."""
    if not set(cpu_quant.AMX_FLAGS) <= set(cpu_build._cpu_flags().split()):
        return False
    ok, why = cpu_quant._probe_runs("amx_int8")
    return ok or not ("computed nan" in why or "exit status -4:" in why)


def builds() -> list[str]:
    """Every build this CPU runs (the portable one runs anywhere; the AMX one per amx_runs: a VM may
    list AMX and kill the process that uses it, which here would be pytest's)."""
    flags = set(cpu_build._cpu_flags().split())
    runs = [isa for isa, needed in cpu_quant.NEEDS.items() if set(needed) <= flags and isa != "amx_int8"]
    return (["amx_int8"] if amx_runs() else []) + runs + ["portable"]


@pytest.fixture(params=builds())
def isa(request, monkeypatch):
    monkeypatch.setattr(cpu_quant, "chosen_isa", lambda: request.param)
    return request.param


# (output rows, blocks of K): 37 = two tiles of 16 and a partial one whose second half of 8 rows is
# empty; 27 = a tile and a partial second half (the AVX2 build runs a tile as two halves). Blocks
# (5 and 7 of 32; 2 and 3 of 256) are not multiples of any tile.
SHAPES = {"blocks32": [(37, 5), (27, 7)], "blocks256": [(37, 2), (27, 3)]}


@pytest.mark.parametrize("qtype", TYPES)
def test_matmul_matches_the_reference(isa, qtype):
    per_block = BLOCK_SIZES[TYPE_IDS[qtype]][0]
    gen = torch.Generator().manual_seed(7)
    for n, blocks in SHAPES["blocks256" if per_block == 256 else "blocks32"]:
        parts = packed(qtype, n, blocks, seed=len(qtype) + n)
        weight = cpu_quant.CpuQuantWeight(qtype, parts)
        assert weight.isa == isa
        bias = torch.randn(n, generator=gen)
        # 1: a decode step's GEMV; 3, 7, 15, 17, 65: rows left over after blocks of 4 (and of 8, the
        # AVX-512 build's 4- and 5-bit formats, whose 5-7 rows left over are one block: 13 = 8 + 5,
        # 14 = 8 + 6, 15 = 8 + 7); 300: past one pass of 256
        for m in (1, 3, 5, 6, 7, 13, 14, 15, 17, 65, 300) if n == 37 else (1, 15, 17):
            x = torch.randn(m, blocks * per_block, generator=gen)
            x[0, :5] = 40.0  # an outlier: one group's scale, not the row's
            got = weight.matmul(x, bias)
            expected = qmatmul(x, qtype, parts, bias)
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))
            # and close to the float product (the activations' rounding only)
            full = x @ dequantize(qtype, parts).T + bias
            assert float((got - full).abs().max()) < 0.02 * float(full.abs().max())


def test_extreme_codes_do_not_saturate(isa):
    """The AVX2 build adds products in int16 (maddubs): every weight code at its largest magnitude
    times activations all at +-127 is where an overflow would show (Q8_0's -128, Q6_K's 63)."""
    gen = torch.Generator().manual_seed(5)
    for qtype in TYPES:
        per_block = BLOCK_SIZES[TYPE_IDS[qtype]][0]
        parts = packed(qtype, 16, 1, seed=9)
        for name in ("qweight", "qhigh"):  # every code at its top (Q8_0: -128, the largest magnitude)
            if name in parts:
                parts[name] = torch.full_like(parts[name], -128 if qtype == "Q8_0" else -1)
        weight = cpu_quant.CpuQuantWeight(qtype, parts)
        x = torch.where(torch.rand(3, per_block, generator=gen) < 0.5, -1.0, 1.0)
        x[1] = 1.0  # every product the same sign: the largest sums
        torch.testing.assert_close(weight.matmul(x), qmatmul(x, qtype, parts), rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q6_K"])
def test_large_outputs_take_the_streaming_stores(isa, qtype):
    """Past 4 MB of output with whole 16-float rows, qgemm writes with streaming stores (an
    lm_head's rows, 2^16 bytes apart, fall in one cache set): they must land every value."""
    per_block = BLOCK_SIZES[TYPE_IDS[qtype]][0]
    n, m = 4096, 260  # 260 x 4096 x 4 bytes > 4 MB; past one pass of 256 rows
    parts = packed(qtype, n, 1, seed=4)
    x = torch.randn(m, per_block, generator=torch.Generator().manual_seed(6))
    expected = qmatmul(x, qtype, parts)
    got = cpu_quant.CpuQuantWeight(qtype, parts).matmul(x)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))


@pytest.mark.parametrize("build,dot", [("avx2", "vpmaddubsw"), ("avx_vnni", "{vex} vpdpbusd")])
def test_the_256_bit_builds_hold_no_avx512_instruction(build, dot):
    """They must run on CPUs without AVX-512 (AMD Zen 1-3, Intel client CPUs): no zmm register
    anywhere in the library, and their own dot products in it (not the portable loops)."""
    objdump = shutil.which("objdump")
    if objdump is None:
        pytest.skip("no objdump")
    try:
        library = cpu_build.build("quant_gemm", build)
    except cpu_build.CpuKernelUnavailable:
        pytest.skip(f"this compiler does not build {build} (gcc < 11 has no -mavxvnni)")
    text = subprocess.run([objdump, "-d", str(library)], capture_output=True, text=True, check=True).stdout
    assert "zmm" not in text
    assert text.count(dot) >= 100  # 8 types x rows 1-4 x 8 quads each


@pytest.mark.parametrize("qtype", TYPES)
def test_rows_are_the_dequantized_rows(isa, qtype):
    parts = packed(qtype, 21, 1 if BLOCK_SIZES[TYPE_IDS[qtype]][0] == 256 else 3, seed=3)
    ids = torch.tensor([20, 0, 7, 7, 16])
    got = cpu_quant.CpuQuantWeight(qtype, parts).rows(ids)
    assert torch.equal(got, dequantize(qtype, {k: v[ids] for k, v in parts.items()}))


def test_weights_stay_packed():
    parts = packed("Q4_1", 64, 8, seed=1)
    weight = cpu_quant.CpuQuantWeight("Q4_1", parts)
    assert weight.nbytes == sum(t.numel() * t.element_size() for t in parts.values())  # re-laid, not dequantized
    assert {t.dtype for t in weight.tiles.values()} == {torch.uint8, torch.float16}


def test_bad_arguments_are_refused():
    weight = cpu_quant.CpuQuantWeight("Q8_0", packed("Q8_0", 16, 2, seed=2))
    with pytest.raises(ValueError, match=r"x must be a float32 CPU tensor \[M, 64\]"):
        weight.matmul(torch.zeros(2, 32))
    with pytest.raises(ValueError, match="x must be a float32"):
        weight.matmul(torch.zeros(2, 64, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"bias must be float32 \[16\]"):
        weight.matmul(torch.zeros(2, 64), torch.zeros(15))
    with pytest.raises(ValueError, match=r"row ids must be in \[0, 16\); got 0..16"):
        weight.rows(torch.tensor([0, 16]))
    with pytest.raises(ValueError, match="a Q4_1 matrix needs mins"):
        cpu_quant.CpuQuantWeight("Q4_1", {k: v for k, v in packed("Q4_1", 16, 1, 0).items() if k != "mins"})
    with pytest.raises(ValueError, match="no CPU kernel for 'Q2_K'"):
        cpu_quant.CpuQuantWeight("Q2_K", {})


# -- which build runs -------------------------------------------------------------------------------
@pytest.fixture
def fresh_choice():
    cpu_quant.chosen_isa.cache_clear()
    yield
    cpu_quant.chosen_isa.cache_clear()


@pytest.mark.parametrize("flags,expected,level,says", [
    ("fpu sse2 avx2 fma f16c", "avx2", logging.INFO, "the avx2 build"),
    ("fpu sse2", "portable", logging.WARNING, "falling back to the portable C kernel")])
def test_a_cpu_without_vnni_falls_back_with_one_line(fresh_choice, monkeypatch, caplog, flags, expected, level, says):
    if expected == "avx2" and "avx2" not in builds():
        pytest.skip("this CPU cannot run the AVX2 build's probe")
    monkeypatch.setattr(cpu_build, "_cpu_flags", lambda: "flags : " + flags)
    with caplog.at_level(logging.INFO, logger="kernels.cpu.quant"):
        assert cpu_quant.chosen_isa() == expected
        assert cpu_quant.chosen_isa() == expected
    assert [(r.levelno, says in r.getMessage()) for r in caplog.records] == [(level, True)]
    assert "amx_int8: the CPU does not list avx512f, avx512bw" in caplog.records[0].getMessage()
    assert "avx512_vnni: the CPU does not list avx512f, avx512bw" in caplog.records[0].getMessage()
    assert "avx_vnni: the CPU does not list" in caplog.records[0].getMessage()


def test_the_isa_can_be_forced(fresh_choice, monkeypatch):
    monkeypatch.setenv("INFLIGHT_CPU_ISA", "avx2")
    assert cpu_quant.chosen_isa() == "avx2"
    assert cpu_quant.CpuQuantWeight("Q4_0", packed("Q4_0", 16, 1, seed=0)).isa == "avx2"
    cpu_quant.chosen_isa.cache_clear()
    monkeypatch.setenv("INFLIGHT_CPU_ISA", "avx512")
    with pytest.raises(ValueError, match="INFLIGHT_CPU_ISA='avx512'; one of amx_int8, avx512_vnni, avx_vnni, avx2, portable"):
        cpu_quant.chosen_isa()


def test_a_probe_that_dies_falls_back(fresh_choice, monkeypatch, caplog, tmp_path):
    # A library whose probe executes an illegal instruction (ud2): what a VM that lists an ISA it
    # does not allow does to the real build. The child dies of SIGILL; the engine does not.
    src = tmp_path / "trap.c"
    src.write_text("float probe(void) { __builtin_trap(); return 0.0f; }\n")
    lib = tmp_path / "trap.so"
    subprocess.run(["gcc", "-shared", "-fPIC", str(src), "-o", str(lib)], check=True)
    ok, why = cpu_quant.probe_library(lib)
    assert not ok and "its probe died (exit status -4" in why
    monkeypatch.setattr(cpu_build, "_cpu_flags", lambda: "flags : " + " ".join(cpu_quant.VNNI_FLAGS))
    monkeypatch.setattr(cpu_quant, "_probe_runs", lambda isa: cpu_quant.probe_library(lib))
    with caplog.at_level(logging.WARNING, logger="kernels.cpu.quant"):
        assert cpu_quant.chosen_isa() == "portable"
    assert "its probe died" in caplog.text


def test_a_build_that_does_not_compile_falls_back(fresh_choice, monkeypatch, caplog):
    def build(name, isa=None):
        if isa == "avx_vnni":
            raise cpu_build.CpuKernelUnavailable("gcc ... failed:\ngcc: error: unrecognized command-line option '-mavxvnni'")
        return real_build(name, isa)
    real_build = cpu_build.build
    if "avx2" not in builds():
        pytest.skip("this CPU cannot run the AVX2 build")
    monkeypatch.setattr(cpu_build, "_cpu_flags", lambda: "flags : " + " ".join(cpu_quant.AVX_VNNI_FLAGS))
    monkeypatch.setattr(cpu_build, "build", build)
    with caplog.at_level(logging.INFO, logger="kernels.cpu.quant"):
        assert cpu_quant.chosen_isa() == "avx2"
    assert "avx_vnni: it did not compile (gcc: error: unrecognized command-line option '-mavxvnni')" in caplog.text


def test_the_real_probe_passes_where_the_cpu_lists_vnni():
    flags = set(cpu_build._cpu_flags().split())
    if not set(cpu_quant.VNNI_FLAGS) <= flags:
        pytest.skip("this CPU does not list AVX512-VNNI")
    assert cpu_quant._probe_runs("avx512_vnni") == (True, "")


def test_the_build_cache_is_keyed_by_the_headers_too(tmp_path, monkeypatch):
    # quant_gemm.c #includes quant_gemm_avx2.h: an edited header must rebuild, not load a stale library
    src = tmp_path / "csrc"
    shutil.copytree(cpu_build.CSRC, src)
    monkeypatch.setattr(cpu_build, "CSRC", src)
    monkeypatch.setenv("INFLIGHT_CACHE_DIR", str(tmp_path / "cache"))
    first = cpu_build.build("quant_gemm", "portable")
    header = src / "quant_gemm_avx2.h"
    header.write_text(header.read_text() + "\n/* edited */\n")
    assert cpu_build.build("quant_gemm", "portable") != first
