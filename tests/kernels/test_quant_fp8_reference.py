"""`quantization=fp8` on CPU: kernels/quant_formats.py `quantize_fp8` (the loader's quantizer) and the
FP8 reference the GPU kernel is checked against (kernels/gpu/quant_bench.py on a GPU; the interpreter
cannot run e4m3). The oracle here is the e4m3 value grid itself: all 256 byte patterns."""
import pytest
import torch

from kernels.quant_formats import FP8_MAX, dequantize, linear_reference, logical_shape, quantize_fp8

GRID = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
GRID = GRID[torch.isfinite(GRID)].unique()          # every finite e4m3 value, sorted


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_codes_are_the_nearest_e4m3_values_of_the_row_scaled_weight(dtype):
    gen = torch.Generator().manual_seed(3)
    w = (torch.randn(37, 203, generator=gen) * torch.logspace(-3, 1, 37)[:, None]).to(dtype)
    w[5] = 0.0                                        # an all-zero row
    parts = quantize_fp8(w)
    q, scales = parts["qweight"], parts["scales"]
    assert q.dtype == torch.float8_e4m3fn and q.shape == (37, 203)
    assert scales.dtype == torch.float32 and scales.shape == (37, 1) and logical_shape("FP8", parts) == (37, 203)
    amax = w.float().abs().amax(dim=1, keepdim=True)
    expected_scales = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    assert torch.equal(scales, expected_scales)       # the scale math in float32
    assert torch.equal(q[5].float(), torch.zeros(203))
    # each row's largest |w| becomes +-448 exactly
    rows = torch.arange(37) != 5
    assert torch.equal(q.float().abs().amax(dim=1)[rows], torch.full((36,), FP8_MAX))
    # every code is a nearest grid value of w / scale (rounding, not truncation)
    target = w.float() / scales
    dist = (GRID[None, None, :] - target[..., None]).abs()
    assert torch.allclose((q.float() - target).abs(), dist.min(dim=-1).values, rtol=0, atol=0)


def test_dequantized_weights_and_the_linear_reference():
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(24, 96, generator=gen, dtype=torch.bfloat16)
    parts = quantize_fp8(w)
    deq = dequantize("FP8", parts)
    assert torch.equal(deq, parts["qweight"].float() * parts["scales"])
    # e4m3 keeps 3 mantissa bits: each weight within 2^-4 of itself relative, or in the subnormal
    # range within half the smallest step times the scale
    err = (deq - w.float()).abs()
    assert (err <= w.float().abs() * 2.0 ** -4 + parts["scales"] * 2.0 ** -10).all()
    x = torch.randn(3, 96, generator=gen, dtype=torch.float16)
    bias = torch.randn(24, generator=gen)
    want = (x.float() @ deq.T + bias).to(torch.float16)
    assert torch.equal(linear_reference(x, "FP8", parts, bias), want)


def test_non_finite_or_non_matrix_weights_are_refused():
    with pytest.raises(ValueError, match="inf or NaN"):
        quantize_fp8(torch.tensor([[1.0, float("inf")]]))
    with pytest.raises(ValueError, match="2-D float matrix"):
        quantize_fp8(torch.ones(4))
    with pytest.raises(ValueError, match="2-D float matrix"):
        quantize_fp8(torch.ones(2, 2, dtype=torch.int32))
