"""The CPU's grouped experts, every active expert in one C call per projection: the float kernel
(kernels/cpu/csrc/moe_gemm.c on pack_panels' layout) against kernels/moe_reference.py `expert_gemm`
(float64 sums) and `grouped_moe` (one GEMM pair per expert), float32 and bfloat16 weights, in every
build this CPU runs (native, AVX2, portable); the packed-quantized one (quant_gemm.c
`qgemm_experts`) against the per-expert int8 kernel, row for row. Odd row counts, experts with no
rows, blocks of rows past the register file's, K past one run of weights, top-1 and top-2."""
import pytest
import torch

from backend.models.quant_linear import quantize_q8_0
from kernels.cpu import build as cpu_build
from kernels.cpu import moe as cpu_moe
from kernels.cpu import quant as cpu_quant
from kernels.moe_reference import expert_gemm, grouped_moe, route
from kernels.reference import silu_mul
from test_cpu_quant import builds as quant_builds
from test_cpu_quant import packed


def float_builds() -> list:
    """None (-march=native: AVX-512 where the CPU has it, the engine's build), then the AVX2 build
    where the CPU runs it and the portable one (SSE2 on x86-64): what other CPUs get."""
    return [None] + (["avx2"] if {"avx2", "fma"} <= set(cpu_build._cpu_flags().split()) else []) + ["portable"]


def offsets_of(counts: list[int]) -> torch.Tensor:
    return torch.tensor([0] + counts).cumsum(0)


# rows per expert: zero-row experts first, last and between; one past a block of 28 (AVX-512's one
# panel) and of 14 (two panels); single rows
COUNTS = [0, 3, 29, 0, 1, 16, 15, 0]


@pytest.mark.parametrize("isa", float_builds(), ids=str)
@pytest.mark.parametrize("dtype,n,k", [(torch.float32, 40, 150), (torch.bfloat16, 33, 301)])
def test_expert_gemm_matches_the_float64_reference(isa, dtype, n, k):
    """n not a whole number of 16-column panels, k past one run of 64 lines (float32: 64 k,
    bfloat16: 128), odd for bfloat16 (a zero k pads the last pair)."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(len(COUNTS), n, k, generator=g).to(dtype)
    x = torch.randn(sum(COUNTS), k, generator=g)
    offsets = offsets_of(COUNTS)
    got = cpu_moe.expert_gemm(x, cpu_moe.pack_panels(w), n, offsets, isa)
    want = expert_gemm(x, w, offsets)
    # each output is one float32 accumulator over k: within k roundings of its terms' magnitudes
    bound = 2 * k * torch.finfo(torch.float32).eps * (x.abs() @ w.float().abs().amax(0).T).max()
    assert got.shape == want.shape and torch.isfinite(got).all()
    assert (got - want).abs().max() <= bound


@pytest.mark.parametrize("isa", float_builds(), ids=str)
def test_expert_gemm_strided_rows_and_no_rows(isa):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(3, 20, 48, generator=g)
    wide = torch.randn(7, 64, generator=g)
    offsets = offsets_of([2, 0, 5])
    got = cpu_moe.expert_gemm(wide[:, :48], cpu_moe.pack_panels(w), 20, offsets, isa)   # rows 64 apart
    torch.testing.assert_close(got, expert_gemm(wide[:, :48], w, offsets), rtol=1e-5, atol=1e-5)
    empty = cpu_moe.expert_gemm(torch.empty(0, 48), cpu_moe.pack_panels(w), 20, torch.zeros(4, dtype=torch.int64))
    assert empty.shape == (0, 20)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,top_k", [(1, 1), (13, 1), (37, 2)])
def test_grouped_moe_matches_one_gemm_pair_per_expert(dtype, tokens, top_k):
    """The whole layer: sort, one call per projection, SiLU·mul, weighted sum; expert 5 never
    chosen (its router column pushed down), so it runs with no rows."""
    e, h, inter = 6, 64, 40
    g = torch.Generator().manual_seed(tokens)
    w13 = (torch.randn(e, 2 * inter, h, generator=g) / 8).to(dtype)
    w2 = (torch.randn(e, h, inter, generator=g) / 6).to(dtype)
    x = torch.randn(tokens, h, generator=g)
    logits = torch.randn(tokens, e, generator=g)
    logits[:, 5] = -1e4
    weights, ids = route(logits, top_k, renormalize=True)
    got = cpu_moe.grouped_moe(x, cpu_moe.pack_panels(w13), cpu_moe.pack_panels(w2), weights, ids, inter, silu_mul)
    want = grouped_moe(x, w13, w2, weights, ids)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not (ids == 5).any()


def test_bad_arguments_are_refused():
    w = cpu_moe.pack_panels(torch.randn(2, 16, 8))
    x = torch.randn(3, 8)
    for offsets, message in ((torch.tensor([0, 2, 2]), "rise from 0 to the 3 rows"),
                             (torch.tensor([0, 3]), r"int64 \[3\]"), (torch.tensor([0, 3, 1]), "rise")):
        with pytest.raises(ValueError, match=message):
            cpu_moe.expert_gemm(x, w, 16, offsets)
    with pytest.raises(ValueError, match="K = 9 inputs"):
        cpu_moe.expert_gemm(torch.randn(3, 9), w, 16, offsets_of([1, 2]))
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        cpu_moe.pack_panels(torch.randn(2, 16, 8).half())
    with pytest.raises(ValueError, match="expert ids reach 2"):
        cpu_moe.grouped_moe(x, w, cpu_moe.pack_panels(torch.randn(2, 8, 8)), torch.ones(3, 1),
                            torch.tensor([[0], [2], [1]]), 8, silu_mul)


@pytest.fixture(params=quant_builds())
def quant_isa(request, monkeypatch):
    monkeypatch.setattr(cpu_quant, "chosen_isa", lambda: request.param)
    return request.param


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K"])
def test_quant_experts_equal_the_per_expert_kernel(quant_isa, qtype):
    """One call for every expert gives each row exactly what that expert's own matmul gives it (the
    same tile code, activations quantized per row): rows past a chunk of 256, zero-row experts."""
    counts = [0, 5, 259, 0, 2]
    n, blocks = 40, 1
    g = torch.Generator().manual_seed(2)
    if qtype == "Q8_0":
        weights = [cpu_quant.CpuQuantWeight(qtype, quantize_q8_0(torch.randn(n, 64, generator=g))) for _ in counts]
    else:
        weights = [cpu_quant.CpuQuantWeight(qtype, packed(qtype, n, blocks, seed)) for seed in range(len(counts))]
    k = weights[0].in_features
    x = torch.randn(sum(counts), k, generator=g)
    offsets = offsets_of(counts)
    got = cpu_quant.CpuQuantExperts(weights).matmul(x, offsets)
    bounds = offsets.tolist()
    want = torch.cat([w.matmul(x[a:b]) for w, a, b in zip(weights, bounds, bounds[1:])])
    assert weights[0].isa == quant_isa
    assert torch.equal(got, want)


def test_quant_experts_refuse_mixed_experts_and_bad_offsets():
    a = cpu_quant.CpuQuantWeight("Q8_0", quantize_q8_0(torch.randn(16, 32)))
    b = cpu_quant.CpuQuantWeight("Q8_0", quantize_q8_0(torch.randn(32, 32)))
    with pytest.raises(ValueError, match=r"expert 1 is Q8_0 \[32, 32\]"):
        cpu_quant.CpuQuantExperts([a, b])
    experts = cpu_quant.CpuQuantExperts([a, a])
    with pytest.raises(ValueError, match="rise from 0 to the 4 rows"):
        experts.matmul(torch.randn(4, 32), torch.tensor([0, 1, 3]))
    with pytest.raises(ValueError, match=r"float32 CPU tensor \[R, 32\]"):
        experts.matmul(torch.randn(4, 16), torch.tensor([0, 1, 4]))


def test_bfloat16_experts_stay_with_onednn_only_where_it_runs_amx(monkeypatch):
    """float32 experts always take the panels; bfloat16 ones unless oneDNN runs AMX tiles (the CPU
    lists amx_bf16 and ONEDNN_MAX_CPU_ISA leaves it on)."""
    monkeypatch.setattr(cpu_build, "_cpu_flags", lambda: "flags : avx512f avx512_bf16 amx_tile amx_bf16")
    monkeypatch.setattr(torch._C._cpu, "_init_amx", lambda: True, raising=False)
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    assert cpu_moe.panels_serve(torch.float32) and not cpu_moe.panels_serve(torch.bfloat16)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")
    assert cpu_moe.panels_serve(torch.bfloat16)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "avx512_core_amx")
    assert not cpu_moe.panels_serve(torch.bfloat16)
    monkeypatch.setattr(cpu_build, "_cpu_flags", lambda: "flags : avx2 fma f16c")
    assert cpu_moe.panels_serve(torch.bfloat16) and not cpu_moe.panels_serve(torch.float16)
