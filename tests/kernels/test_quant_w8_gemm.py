"""kernels/gpu/quant_w8_gemm.py (W8A16) against the dequantized reference under the Triton interpreter,
fp32 and fp16: Q8_0 as the importer packs it, INT8 with one scale per output channel (K not a
multiple of anything) and per group of 64; decode, split-K and prefill batches, bias. FP8 runs
only on a GPU (the interpreter cannot cast e4m3): its check is in kernels/gpu/quant_bench.py."""
import pytest
import torch

from kernel_testutil import DEVICE, DTYPES, seed_for
from kernels.quant_formats import linear_reference
from kernels.gpu.quant_w8_gemm import w8_linear
from quant_testutil import assert_quant_close, gguf_matrix

CASES = [(1, 40, None, False), (6, 72, 3, True), (70, 33, None, True)]   # (M, N, split_k, bias)


def int8_matrix(n: int, k: int, groups: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    scales = torch.rand(n, groups, generator=gen) * 0.02 + 1e-3
    return {"qweight": q.to(DEVICE), "scales": scales.to(DEVICE)}


MATRICES = {  # name -> (qtype, K, maker)
    "Q8_0": ("Q8_0", 352, lambda n, k, s: gguf_matrix("Q8_0", n, k, s)),
    "INT8-channel": ("INT8", 203, lambda n, k, s: int8_matrix(n, k, 1, s)),
    "INT8-group64": ("INT8", 448, lambda n, k, s: int8_matrix(n, k, 7, s)),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", list(MATRICES))
@pytest.mark.parametrize("m,n,split_k,with_bias", CASES)
def test_w8_linear_matches_the_dequantized_reference(kind, dtype, m, n, split_k, with_bias):
    qtype, k, make = MATRICES[kind]
    seed = seed_for(kind, m, n)
    parts = make(n, k, seed)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(dtype).to(DEVICE)
    bias = torch.randn(n, generator=gen).to(DEVICE) if with_bias else None
    got = w8_linear(x, qtype, parts, bias, split_k=split_k)
    assert_quant_close(got, linear_reference(x, qtype, parts, bias), x, qtype, parts, f"{kind} {dtype} M={m}")


def test_bad_arrays_are_refused_naming_the_array():
    parts = int8_matrix(8, 96, 3, seed=1)
    x = torch.zeros(2, 96, device=DEVICE)
    with pytest.raises(ValueError, match="no 8-bit kernel for 'INT4'"):
        w8_linear(x, "INT4", parts)
    with pytest.raises(ValueError, match="Q8_0 scales need K / 32 columns"):
        w8_linear(x, "Q8_0", {**parts, "scales": parts["scales"][:, :2].half().contiguous()})
    with pytest.raises(ValueError, match="INT8 scales need a column count dividing K"):
        w8_linear(x, "INT8", {**parts, "scales": torch.ones(8, 5, device=DEVICE)})
    with pytest.raises(ValueError, match="qweight must have dtype in \\(int8\\)"):
        w8_linear(x, "INT8", {**parts, "qweight": parts["qweight"].view(torch.uint8)})
    with pytest.raises(ValueError, match="qweight must have dtype in \\(float8_e4m3fn\\)"):
        w8_linear(x, "FP8", parts)
    with pytest.raises(ValueError, match="missing scales"):
        w8_linear(x, "INT8", {"qweight": parts["qweight"]})
