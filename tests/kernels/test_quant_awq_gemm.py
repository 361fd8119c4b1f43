"""AWQ: the packing order against the documented one (AutoAWQ's GEMM format as vLLM loads it), and
kernels/gpu/quant_awq_gemm.py against the dequantized reference under the Triton interpreter, fp32 and
fp16: groups of 128, 64 and 32, N a multiple of 8 but not of the tiles, decode, split-K, prefill."""
import pytest
import torch

from kernel_testutil import DEVICE, DTYPES, seed_for
from kernels.gpu.quant_awq_gemm import awq_linear
from kernels.quant_formats import dequantize_awq, linear_reference, logical_shape, pack_awq, quantize_awq, unpack_awq
from quant_testutil import assert_quant_close

CASES = [(1, 40, None, False), (6, 72, 3, True), (70, 24, None, True)]   # (M, N, split_k, bias)


def test_packing_follows_the_awq_order():
    """Output 8c + i sits in nibble j with ORDER[j] = i, ORDER = (0, 2, 4, 6, 1, 3, 5, 7): codes equal
    to their output index pack to nibbles 0, 2, 4, 6, 1, 3, 5, 7 from the lowest, 0x75316420."""
    codes = torch.arange(8).repeat(3, 2)                       # [3, 16]
    packed = pack_awq(codes)
    assert packed.dtype == torch.int32 and packed.shape == (3, 2)
    assert (packed == 0x75316420).all()
    assert torch.equal(unpack_awq(packed), codes.to(torch.int32))
    top = pack_awq(torch.full((1, 8), 15))                       # all bits set: -1 as int32
    assert top.item() == -1 and torch.equal(unpack_awq(top), torch.full((1, 8), 15, dtype=torch.int32))


def test_quantize_awq_round_trips_within_half_a_step():
    w = torch.randn(16, 256, generator=torch.Generator().manual_seed(0))
    parts = quantize_awq(w, group=128)
    assert parts["qweight"].shape == (256, 2) and parts["qzeros"].shape == (2, 2) and parts["scales"].shape == (2, 16)
    groups = w.t().reshape(2, 128, 16)          # [K / G, G, N]: AWQ's asymmetric grid, 16 levels per group
    assert torch.equal(parts["scales"], ((groups.amax(dim=1) - groups.amin(dim=1)) / 15).half())
    step = parts["scales"].float().repeat_interleave(128, dim=0).t()
    err = (dequantize_awq(parts) - w).abs()
    # rounding to the grid: half a step, plus at most one more step where the 4-bit range clips
    assert (err <= 1.5 * step + 1e-6).all() and (err <= 0.5 * step + 1e-6).float().mean() > 0.95


def awq_matrix(n: int, k: int, group: int, seed: int) -> dict[str, torch.Tensor]:
    """Random codes, zeros and scales (every code value and zero point occurs)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (k, n), generator=gen)
    z = torch.randint(0, 16, (k // group, n), generator=gen)
    scales = (torch.rand(k // group, n, generator=gen) * 0.02 + 1e-3).half()
    return {"qweight": pack_awq(q).to(DEVICE), "qzeros": pack_awq(z).to(DEVICE), "scales": scales.to(DEVICE)}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("k,group", [(384, 128), (192, 64), (160, 32)])
@pytest.mark.parametrize("m,n,split_k,with_bias", CASES)
def test_awq_linear_matches_the_dequantized_reference(k, group, dtype, m, n, split_k, with_bias):
    seed = seed_for(k, m, n)
    parts = awq_matrix(n, k, group, seed)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(dtype).to(DEVICE)
    bias = torch.randn(n, generator=gen).to(DEVICE) if with_bias else None
    assert logical_shape("AWQ", parts) == (n, k)
    got = awq_linear(x, parts, bias, split_k=split_k)
    assert_quant_close(got, linear_reference(x, "AWQ", parts, bias), x, "AWQ", parts, f"AWQ g{group} {dtype} M={m}")


def test_bad_arrays_are_refused_naming_the_array():
    parts = awq_matrix(16, 256, 128, seed=1)
    x = torch.zeros(2, 256, device=DEVICE)
    with pytest.raises(ValueError, match="missing qzeros"):
        awq_linear(x, {"qweight": parts["qweight"], "scales": parts["scales"]})
    with pytest.raises(ValueError, match="scales need a row count dividing K = 256"):
        awq_linear(x, {**parts, "scales": torch.ones(3, 16, dtype=torch.float16, device=DEVICE)})
    with pytest.raises(ValueError, match=r"qzeros must have shape \(2, 2\)"):
        awq_linear(x, {**parts, "qzeros": parts["qzeros"][:1]})
    with pytest.raises(ValueError, match="group size must be a multiple of 16"):
        awq_linear(torch.zeros(2, 24, device=DEVICE), {"qweight": parts["qweight"][:24], "qzeros": parts["qzeros"],
                                                       "scales": parts["scales"]})
    with pytest.raises(ValueError, match="scales must have dtype"):
        awq_linear(x, {**parts, "scales": parts["scales"].float()})
    with pytest.raises(ValueError, match="the output dimension must be a multiple of 8"):
        pack_awq(torch.zeros(2, 12, dtype=torch.int64))
