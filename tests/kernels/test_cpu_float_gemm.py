"""The float-weight GEMM on the CPU (kernels/cpu/csrc/float_gemm.c) against its torch reference,
for float32, bfloat16 and float16 weights, in every build this CPU runs (AVX-512 with vdpbf16ps,
AVX-512, AVX2, portable); each row's result independent of the rows beside it (the C layer stack's
bit-for-bit promise rests on it); and the choice of build, which falls back saying why."""
import logging

import pytest
import torch

from kernels.cpu import build as cpu_build
from kernels.cpu import float_gemm

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def builds() -> list[str]:
    flags = set(cpu_build._cpu_flags().split())
    return [isa for isa, needed in float_gemm.NEEDS.items() if set(needed) <= flags] + ["portable"]


@pytest.fixture(params=builds())
def isa(request):
    return request.param


# (N, K): 37 and 5 weight rows are no multiple of any block (4 or 2 rows, 16 a work item); K 32 to 160
SHAPES = [(37, 160), (5, 32), (21, 96)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matmul_matches_the_reference(isa, dtype):
    gen = torch.Generator().manual_seed(5)
    for n, k in SHAPES:
        w = torch.randn(n, k, generator=gen).to(dtype)
        weight = float_gemm.CpuFloatWeight(w, isa)
        assert weight.isa == isa and weight.weight.data_ptr() == w.data_ptr()  # read in place, no copy
        bias = torch.randn(n, generator=gen)
        for m in (1, 3, 6, 17, 70):  # 70: past one pass of 64 rows
            x = torch.randn(m, k, generator=gen)
            for b in (None, bias):
                got, want = weight.matmul(x, b), float_gemm.reference(x, w, b, isa)
                scale = float_gemm.reference(x.abs(), w.abs()).max()
                assert (got - want).abs().max() <= 1e-5 * scale, (n, k, m, dtype)


def test_bfloat16_weights_take_bfloat16_activations_where_the_build_multiplies_pairs(isa):
    """vdpbf16ps multiplies bfloat16 pairs: the activations are rounded (as oneDNN's bf16 GEMM rounds
    them); the other builds multiply the float32 activations by the widened weights."""
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(16, 64, generator=gen).to(torch.bfloat16)
    x = torch.randn(4, 64, generator=gen) * (1 + 1e-3)  # values far from bfloat16's
    got = float_gemm.CpuFloatWeight(w, isa).matmul(x)
    rounded = (x.to(torch.bfloat16).double() @ w.double().T).float()
    exact = (x.double() @ w.double().T).float()
    near, far = (rounded, exact) if isa in float_gemm.BF16_PAIRS else (exact, rounded)
    assert (got - near).abs().max() < 1e-5 < (got - far).abs().max()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_row_gets_the_same_bits_alone_as_beside_others(isa, dtype):
    """The Python layers and the C layer stack may run a row in different steps' GEMMs: its
    result must not depend on the block or pass of rows it falls in."""
    gen = torch.Generator().manual_seed(2)
    weight = float_gemm.CpuFloatWeight(torch.randn(37, 96, generator=gen).to(dtype), isa)
    x, bias = torch.randn(70, 96, generator=gen), torch.randn(37, generator=gen)
    together = weight.matmul(x, bias)
    for i in (0, 3, 5, 63, 64, 69):
        assert torch.equal(weight.matmul(x[i:i + 1], bias)[0], together[i])
        assert torch.equal(weight.matmul(x[i - 2:i + 3] if i >= 2 else x[:5], bias)[min(i, 2)], together[i])


def test_bad_inputs_are_refused_by_name():
    with pytest.raises(ValueError, match="K a multiple of 32; got torch.float32 \\(8, 48\\)"):
        float_gemm.CpuFloatWeight(torch.zeros(8, 48))
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        float_gemm.CpuFloatWeight(torch.zeros(8, 64, dtype=torch.float64))
    weight = float_gemm.CpuFloatWeight(torch.zeros(8, 64))
    with pytest.raises(ValueError, match="x must be a float32 CPU tensor \\[M, 64\\]"):
        weight.matmul(torch.zeros(2, 32))
    with pytest.raises(ValueError, match="bias must be float32 \\[8\\]"):
        weight.matmul(torch.zeros(2, 64), torch.zeros(9))
    assert weight.matmul(torch.zeros(0, 64)).shape == (0, 8)


# -- which build runs -------------------------------------------------------------------------------
@pytest.fixture
def fresh_choice(monkeypatch):
    monkeypatch.delenv("INFLIGHT_CPU_ISA", raising=False)
    monkeypatch.delenv("INFLIGHT_FLOAT_ISA", raising=False)
    float_gemm.chosen_isa.cache_clear()
    yield
    float_gemm.chosen_isa.cache_clear()


def test_a_cpu_without_avx512_falls_back_saying_why(fresh_choice, monkeypatch, caplog):
    monkeypatch.setattr(cpu_build, "_cpu_flags", lambda: "fpu sse2 avx2 fma f16c")
    with caplog.at_level(logging.INFO, logger="kernels.cpu.float_gemm"):
        assert float_gemm.chosen_isa() == ("avx2" if "avx2" in builds() else "portable")
    said = [r.getMessage() for r in caplog.records if r.name == "kernels.cpu.float_gemm"][0]
    assert "avx512_bf16: the CPU does not list avx512f, avx512bw" in said and "avx512: the CPU does not list" in said
    float_gemm.chosen_isa.cache_clear()
    monkeypatch.setattr(cpu_build, "_cpu_flags", lambda: "fpu sse2")
    assert float_gemm.chosen_isa() == "portable"


def test_the_packed_kernels_forced_build_caps_this_one(fresh_choice, monkeypatch):
    """INFLIGHT_CPU_ISA=avx2 (how the tests force the AVX2 build of the packed kernels) forces the
    AVX2 build here too; INFLIGHT_FLOAT_ISA forces any build; an unknown one is refused by name."""
    monkeypatch.setenv("INFLIGHT_CPU_ISA", "avx2")
    assert float_gemm.chosen_isa() == ("avx2" if "avx2" in builds() else "portable")
    float_gemm.chosen_isa.cache_clear()
    monkeypatch.setenv("INFLIGHT_CPU_ISA", "portable")
    assert float_gemm.chosen_isa() == "portable"
    float_gemm.chosen_isa.cache_clear()
    monkeypatch.setenv("INFLIGHT_FLOAT_ISA", "avx512")
    assert float_gemm.chosen_isa() == "avx512"
    float_gemm.chosen_isa.cache_clear()
    monkeypatch.setenv("INFLIGHT_FLOAT_ISA", "avx512_vnni")
    with pytest.raises(ValueError, match="INFLIGHT_FLOAT_ISA='avx512_vnni'; one of avx512_bf16, avx512, avx2, portable"):
        float_gemm.chosen_isa()


def test_a_probe_that_computes_the_wrong_sum_falls_back(fresh_choice, monkeypatch, caplog):
    """A build whose probe runs but gets another sum (a CPU that executes vdpbf16ps wrongly, say)
    is not used: the next build is."""
    first = builds()[0]
    if first == "portable":
        pytest.skip("no intrinsics build runs on this CPU")
    monkeypatch.setattr(float_gemm, "_probe_expected", lambda: -1.0)
    with caplog.at_level(logging.INFO, logger="kernels.cpu.float_gemm"):
        assert float_gemm.chosen_isa() == "portable"
    assert f"{first}: its probe computed" in caplog.text and "not -1.0" in caplog.text
