"""backend/models/float_linear.py's choice of the rows from which a float layer runs oneDNN's GEMM
instead of the C kernel: lowered for bfloat16 where oneDNN runs AMX tiles, opened for float16 where
it has an fp16 kernel (AVX512-FP16), float16 and (on the AVX2 build) bfloat16 widened to float32
slices where it has none, and never where ONEDNN_MAX_CPU_ISA caps oneDNN below it."""
import pytest
import torch

from backend.models import float_linear as fl
from kernels.cpu import onednn


@pytest.fixture
def cpu(monkeypatch):
    """Set what the CPU offers: (oneDNN runs AMX bf16, torch reports an fp16 kernel, and a bf16 one:
    every AVX-512 CPU, where a forced AVX2 build runs too)."""
    monkeypatch.delenv("INFLIGHT_FLOAT_ONEDNN_FROM", raising=False)
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)

    def offer(amx: bool, fp16: bool, isa: str = "avx512_bf16", bf16: bool = True):
        from kernels.cpu import float_gemm
        monkeypatch.setattr(float_gemm, "chosen_isa", lambda: isa)
        monkeypatch.setattr(onednn, "runs_amx_bf16", lambda: amx)
        monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_fp16_supported", lambda: fp16)
        monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: bf16)
    return offer


def test_amx_lowers_bfloat16_and_fp16_opens_float16(cpu):
    cpu(amx=True, fp16=True)
    assert fl.float_onednn_from(torch.bfloat16) == fl.ONEDNN_FROM_AMX_BF16 == 16
    assert fl.float_onednn_from(torch.float16) == fl.ONEDNN_FROM_FP16 == 128


@pytest.mark.parametrize("amx, fp16, isa", [(False, False, "avx512_bf16"), (True, True, "avx2")])
def test_without_them_or_with_the_avx2_build_forced_the_builds_table_holds(cpu, amx, fp16, isa):
    """(A forced AVX2 build stands for an AVX2 CPU: no AMX, no AVX512-FP16, no oneDNN bf16 GEMM.)
    float16 from 128 rows either way: on oneDNN's float32 GEMM on the widened weight where it has no
    fp16 kernel; bfloat16 the same way on the AVX2 build."""
    cpu(amx=amx, fp16=fp16, isa=isa)
    table = fl.ONEDNN_FROM[isa]
    assert fl.float_onednn_from(torch.bfloat16) == (fl.ONEDNN_FROM_BF16_WIDENED if isa == "avx2"
                                                    else table[torch.bfloat16])
    assert fl.ONEDNN_FROM_BF16_WIDENED == 128
    assert fl.float_onednn_from(torch.float16) == fl.ONEDNN_FROM_F16_WIDENED == 128
    assert fl.float_onednn_from(torch.float32) == table.get(torch.float32, 0)


def test_float16_widens_only_where_onednn_keeps_the_builds_isa(cpu, monkeypatch):
    """The widened path was measured against oneDNN at the float kernel's own ISA: an AVX2 build under
    ONEDNN_MAX_CPU_ISA=AVX2 (what the benches' forced AVX2 runs set) widens; an AVX-512 build under it
    does not (oneDNN's AVX2 float32 GEMM is slower than the AVX-512 C kernel); the portable build never."""
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    cpu(amx=False, fp16=False, isa="avx2")
    assert fl.float_onednn_from(torch.float16) == 128
    cpu(amx=False, fp16=False, isa="avx512")
    assert fl.float_onednn_from(torch.float16) == 0
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    cpu(amx=False, fp16=False, isa="portable")
    assert fl.float_onednn_from(torch.float16) == 0


def test_bfloat16_widens_on_the_avx2_build_only_where_onednn_keeps_avx2(cpu, monkeypatch):
    """oneDNN's bf16 GEMM needs AVX-512 (capped at AVX2 it refuses the primitive): the AVX2 build's
    bfloat16 prompt rows go through the widened weight, also under the benches' ONEDNN_MAX_CPU_ISA=AVX2
    and with INFLIGHT_FLOAT_ONEDNN_FROM; a cap below AVX2 leaves them on the C kernel; the AVX-512
    builds keep oneDNN's own bf16 GEMM (not widened)."""
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    cpu(amx=False, fp16=False, isa="avx2")
    assert fl.float_onednn_from(torch.bfloat16) == 128 and fl.widened(torch.bfloat16)
    monkeypatch.setenv("INFLIGHT_FLOAT_ONEDNN_FROM", "32")
    assert fl.float_onednn_from(torch.bfloat16) == 32
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "SSE41")
    assert fl.float_onednn_from(torch.bfloat16) == 0 and not fl.widened(torch.bfloat16)
    monkeypatch.delenv("INFLIGHT_FLOAT_ONEDNN_FROM")
    assert fl.float_onednn_from(torch.bfloat16) == 0
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    for isa in ("avx512", "avx512_bf16"):
        cpu(amx=False, fp16=False, isa=isa)
        assert fl.float_onednn_from(torch.bfloat16) == fl.ONEDNN_FROM[isa][torch.bfloat16]
        assert not fl.widened(torch.bfloat16)


def test_a_capped_onednn_gets_no_float16_and_the_override_follows_what_it_takes(cpu, monkeypatch):
    cpu(amx=False, fp16=True)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")   # (the golden outputs' setting)
    assert fl.float_onednn_from(torch.float16) == 0
    monkeypatch.setenv("INFLIGHT_FLOAT_ONEDNN_FROM", "32")
    # neither float16 nor bfloat16: capped at AVX2, oneDNN refuses its bf16 primitive (this AVX-512
    # build would not widen, as on the AVX2 one): the C kernel at every row count
    assert fl.float_onednn_from(torch.float16) == 0 and fl.float_onednn_from(torch.bfloat16) == 0
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    assert fl.float_onednn_from(torch.float16) == 32


@pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_fp16_supported(), reason="this CPU has no oneDNN fp16 GEMM")
def test_float16_through_onednn_matches_the_c_kernel_within_fp16_rounding():
    """Where the CPU has it: a float16 layer's prompt rows through oneDNN (the activations rounded
    to float16, as bfloat16's are) against the C kernel's float32 activations."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(576, 1536, bias=False)
    linear.weight.data = (linear.weight.data * 0.5).half()
    layer = fl.FloatLinear(linear, onednn_from=128)
    x = torch.randn(130, 576)
    want = layer.kernel.matmul(x, None)
    got = layer(x)
    assert got.shape == want.shape
    scale = float(want.abs().max())
    assert float((got - want).abs().max()) <= 2e-3 * scale


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_widened_for_onednns_float32_gemm(monkeypatch, bias, dtype):
    """Where oneDNN has no GEMM for the dtype (float16 without its fp16 kernel, bfloat16 on the AVX2
    build): the weight widened to float32 a slice at a time (here 40 rows a slice: 100 outputs are 3
    slices, the last short), 130 rows in calls of 64 (padded to their row buckets): each slice's
    columns are oneDNN's float32 GEMM on that slice exactly, and the whole is the C kernel's product
    within float32 rounding."""
    from kernels.cpu import float_gemm
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.setattr(onednn, "runs_fp16", lambda: False)
    if dtype == torch.bfloat16:   # as the AVX2 build (the C kernel below is that build: this CPU runs it)
        monkeypatch.setattr(float_gemm, "chosen_isa", lambda: "avx2")
    monkeypatch.setattr(fl, "WIDEN_BYTES", 40 * 4 * 96)
    monkeypatch.setattr(fl, "MAX_ROWS", 64)
    torch.manual_seed(1)
    linear = torch.nn.Linear(96, 100, bias=bias)
    linear.weight.data = (linear.weight.data * 0.5).to(dtype)
    layer = fl.FloatLinear(linear, onednn_from=128)
    assert layer.widen
    x = torch.randn(130, 96)
    got = layer(x)
    pointwise = torch.ops.mkldnn._linear_pointwise
    for n0 in (0, 40, 80):
        w = linear.weight.detach()[n0:n0 + 40].float()
        for start in (0, 64, 128):
            part = x[start:start + 64]
            padded = fl.row_bucket(part.shape[0])
            part = torch.nn.functional.pad(part, (0, 0, 0, padded - part.shape[0]))
            want = pointwise(part, w, None, "none", [], "")[:min(64, 130 - start)]
            if bias:
                want = want + linear.bias.detach()[n0:n0 + 40].float()
            assert torch.equal(got[start:start + 64, n0:n0 + 40], want), (n0, start)
    kernel = layer.kernel.matmul(x, layer.float_bias())
    assert float((got - kernel).abs().max()) <= 1e-5 * float(kernel.abs().max())
    assert torch.equal(layer(x[:127]), layer.kernel.matmul(x[:127], layer.float_bias()))   # under 128 rows: the C kernel


def test_an_avx2_only_cpu_widens_bfloat16_and_never_asks_onednn_for_a_bf16_gemm(cpu, monkeypatch):
    """Where torch reports no bf16 kernel (an AVX2-only CPU: oneDNN's bf16 reorder raises there), the
    AVX2 build widens bfloat16 as on a forced one; a build that would take oneDNN's own bf16 GEMM (an
    AVX-512 one, whose CPU this cannot be but for a test) leaves bfloat16 on the C kernel instead."""
    cpu(amx=False, fp16=False, isa="avx2", bf16=False)
    assert fl.float_onednn_from(torch.bfloat16) == fl.ONEDNN_FROM_BF16_WIDENED and fl.widened(torch.bfloat16)
    assert not onednn.runs_bf16()
    cpu(amx=False, fp16=False, isa="avx512", bf16=False)
    assert fl.float_onednn_from(torch.bfloat16) == 0
    monkeypatch.setenv("INFLIGHT_FLOAT_ONEDNN_FROM", "32")
    assert fl.float_onednn_from(torch.bfloat16) == 0
    cpu(amx=False, fp16=False, isa="avx512", bf16=True)
    assert fl.float_onednn_from(torch.bfloat16) == 32 and onednn.runs_bf16()
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")  # (oneDNN capped below its bf16 kernels)
    assert not onednn.runs_bf16() and fl.float_onednn_from(torch.bfloat16) == 0
