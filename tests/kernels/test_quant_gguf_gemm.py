"""kernels/gpu/quant_gguf_gemm.py against the dequantized reference (kernels/quant_reference.py, ggml's
floats bit for bit) under the Triton interpreter, fp32 and fp16 (bf16 only on a GPU): every packed
4/5/6-bit type, batches of 1 (decode), 5 and 17 (K split among programs, the last split shorter), 70
(the prefill tiles), N and K that are not tile multiples, bias, strided rows and activations."""
import pytest
import torch

from kernel_testutil import DEVICE, DTYPES, seed_for
from kernels.quant_formats import linear_reference
from kernels.gpu.quant_gguf_gemm import QTYPES, gguf_linear
from kernels.gpu.quant_tiles import plan_tiles
from quant_testutil import assert_quant_close, gguf_matrix

# (M, N, split_k, bias): N not a multiple of the 64/128 output tiles; split 3 of 11 or 24 K-groups
CASES = [(1, 40, None, False), (5, 72, 3, True), (17, 33, 2, False), (70, 33, None, True)]


def k_for(qtype: str) -> int:
    # 11 groups of 32 (K tiles of 128 leave a partial one), 3 super-blocks of 256 for the K-quants
    return 768 if qtype.endswith("_K") else 352


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("qtype", list(QTYPES))
@pytest.mark.parametrize("m,n,split_k,with_bias", CASES)
def test_gguf_linear_matches_the_dequantized_reference(qtype, dtype, m, n, split_k, with_bias):
    seed = seed_for(qtype, m, n)
    k = k_for(qtype)
    parts = gguf_matrix(qtype, n, k, seed)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(dtype).to(DEVICE)
    bias = torch.randn(n, generator=gen).to(DEVICE) if with_bias else None
    tiles = plan_tiles(m, n, k, x.device, split_k=split_k)
    assert tiles.split_k == (split_k or 1)
    got = gguf_linear(x, qtype, parts, bias, split_k=split_k)
    assert_quant_close(got, linear_reference(x, qtype, parts, bias), x, qtype, parts,
                       f"{qtype} {dtype} M={m} N={n} split={split_k}")


@pytest.mark.parametrize("qtype", ["Q5_1", "Q6_K"])
def test_strided_rows_and_activations(qtype):
    """Every other row of a matrix (a fused matrix's part is a row slice) and x a column slice of a
    wider buffer: the kernel follows the strides it is given."""
    k = k_for(qtype)
    full = gguf_matrix(qtype, 2 * 24, k, seed=5)
    parts = {a: t[::2] for a, t in full.items()}
    assert parts["qweight"].stride(0) == 2 * parts["qweight"].shape[1]
    buf = torch.randn(6, k + 40, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    x = buf[:, 40:]
    got = gguf_linear(x, qtype, parts, split_k=2)
    dense = {a: t.contiguous() for a, t in parts.items()}
    assert_quant_close(got, linear_reference(x.contiguous(), qtype, dense), x, qtype, dense, qtype)


def test_an_empty_batch_gives_an_empty_result():
    parts = gguf_matrix("Q4_0", 8, 64, seed=1)
    out = gguf_linear(torch.empty(0, 64, device=DEVICE), "Q4_0", parts)
    assert out.shape == (0, 8)


@pytest.mark.parametrize("change,message", [
    (lambda p: p.pop("mins"), "missing mins"),
    (lambda p: p.update(qweight=p["qweight"].view(torch.int8)), "qweight must have dtype"),
    (lambda p: p.update(scales=p["scales"][:, :-1]), "scales must have shape"),
    (lambda p: p.update(scales=p["scales"].float()), "scales must have dtype"),
    (lambda p: p.update(qweight=p["qweight"].t().contiguous().t()), "contiguous along its last dimension"),
])
def test_bad_arrays_are_refused_naming_the_array(change, message):
    parts = gguf_matrix("Q4_1", 16, 64, seed=2)
    change(parts)
    with pytest.raises(ValueError, match=message):
        gguf_linear(torch.zeros(2, 64, device=DEVICE), "Q4_1", parts)


def test_bad_calls_are_refused():
    parts = gguf_matrix("Q4_K", 8, 256, seed=3)
    x = torch.zeros(2, 256, device=DEVICE)
    with pytest.raises(ValueError, match="no GGUF kernel for 'Q2_K'"):
        gguf_linear(x, "Q2_K", parts)
    with pytest.raises(ValueError, match="x has 128 features; the weight takes 256"):
        gguf_linear(x[:, :128], "Q4_K", parts)
    with pytest.raises(ValueError, match="bias must be a contiguous"):
        gguf_linear(x, "Q4_K", parts, torch.zeros(9, device=DEVICE))
    with pytest.raises(ValueError, match="Q4_K needs K a multiple of 256; qweight gives K = 128"):
        gguf_linear(x, "Q4_K", {**parts, "qweight": parts["qweight"][:, :64]})
    with pytest.raises(ValueError, match=r"split_k must be in \[1, 16\]"):
        gguf_linear(x, "Q4_K", parts, split_k=0)
