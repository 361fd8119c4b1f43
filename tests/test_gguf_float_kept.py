"""A GGUF file of F16 or BF16 matrices (llama.cpp's `--outtype f16` / `bf16`) imported with
`inflight import-gguf` and served with dtype=auto keeps its weights in the file's type on the CPU
(issue 47): float16 / bfloat16 tensors that float_gemm.c reads in place (F16C widening, vdpbf16ps),
half the bytes of the float32 copy it loaded before. The C layer stack gives the Python layers'
greedy tokens and top-3 log-probabilities bit for bit on those weights (every kind of step);
dtype=float32 still widens them; without the C kernel, float16 weights fall back to oneDNN on a
float32 copy (oneDNN has no fp16 GEMM on CPUs without avx512_fp16) and still answer."""
import json

import pytest
import torch

from backend import LLM
from backend.models.float_linear import FloatLinear
from backend.models.gguf.importer import import_gguf
from backend.models.packed_linear import PackedLinear
from backend.worker.device import resolve_dtype
from gguf_files import write_gguf
from kernels.cpu import onednn as onednn_caps
from test_native_decode import PARAMS, PROMPTS, assert_the_stack_matches_the_python_layers, run

TYPES = {"F16": torch.float16, "BF16": torch.bfloat16}
# as tests/test_native_decode.py's engines: chunked prompts beside decode rows, no prefix reuse
ENGINE = dict(kv_block_size=16, max_num_seqs=4, max_model_len=128, enable_kv_cache_reuse=False,
              max_num_batched_tokens=24, inter_token_target_ms=0)


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory):
    from backend.models.make_model import make_model
    return make_model(tmp_path_factory.mktemp("tok")) / "tokenizer.json"


@pytest.fixture(scope="module", params=list(TYPES))
def folder(request, tmp_path_factory, tokenizer_json):
    """(GGUF type, the imported folder, the file's weights as float32 before rounding)."""
    tmp = tmp_path_factory.mktemp(request.param)
    weights = write_gguf(tmp / "model.gguf", tokenizer_json, seed=21, types=(request.param,), tied=False)
    return request.param, import_gguf(tmp / "model.gguf", tmp / "folder", log=lambda *_: None), weights


def float_layers(llm: LLM) -> list[FloatLinear]:
    return [m for m in llm.engine.runner.model.modules() if isinstance(m, FloatLinear)]


def test_the_import_says_the_files_type(folder):
    kind, path, _ = folder
    config = json.loads((path / "config.json").read_text())
    assert config["gguf_float_type"] == kind and config["torch_dtype"] == str(TYPES[kind]).removeprefix("torch.")
    assert "quantization_config" not in config


def test_dtype_auto_keeps_the_files_type_and_values(folder):
    kind, path, weights = folder
    llm = LLM(str(path), **ENGINE)
    runner, dtype = llm.engine.runner, TYPES[kind]
    assert runner.dtype == dtype and runner.model.compute_dtype == torch.float32
    layers = float_layers(llm)
    assert len(layers) == 2 * 4 + 1  # qkv, o, gate_up, down per layer and the lm_head, all on float_gemm.c
    assert {m.weight.dtype for m in layers} == {m.kernel.dtype for m in layers} == {dtype}
    assert runner.model.embed_tokens.weight.dtype == dtype
    down = runner.model.layers[1].mlp.down_proj
    assert down.kernel.weight.data_ptr() == down.weight.data_ptr()  # read in place, no copy
    assert torch.equal(down.weight, torch.from_numpy(weights["model.layers.1.mlp.down_proj.weight"]).to(dtype))
    assert runner.kv_dtype == torch.bfloat16  # the C attention's 16 bits (float16 has none there)
    assert "quantization=none (" + str(dtype).removeprefix("torch.") in runner.weights.summary


def test_the_c_stack_gives_the_python_layers_results_bit_for_bit(folder):
    llm = LLM(str(folder[1]), **ENGINE)
    assert {m.weight.dtype for m in float_layers(llm)} == {TYPES[folder[0]]}
    assert_the_stack_matches_the_python_layers(llm)


def test_the_avx2_build_too(folder, monkeypatch):
    from kernels.cpu import float_gemm
    monkeypatch.setenv("INFLIGHT_FLOAT_ISA", "avx2")
    float_gemm.chosen_isa.cache_clear()
    try:
        llm = LLM(str(folder[1]), **ENGINE)
        assert {m.kernel.isa for m in float_layers(llm)} == {"avx2"}
        assert_the_stack_matches_the_python_layers(llm)
    finally:
        float_gemm.chosen_isa.cache_clear()


def test_an_explicit_float32_still_widens_them_to_the_same_answers(folder):
    """float_gemm.c widens a 16-bit weight exactly and multiplies in float32 as for float32 weights:
    an F16 file's answers are float32's to the bit; a BF16 one's where the build does not round the
    activations to bfloat16 (vdpbf16ps), else close."""
    kind, path, _ = folder
    f32, kept = LLM(str(path), dtype="float32", **ENGINE), LLM(str(path), **ENGINE)
    assert f32.engine.runner.dtype == torch.float32
    assert {m.weight.dtype for m in float_layers(f32)} == {torch.float32}
    wide, half = run(f32), run(kept)
    if kind == "F16" or float_layers(kept)[0].kernel.isa != "avx512_bf16":
        assert [t for t, _ in wide] == [t for t, _ in half]
    assert [t[:3] for t, _ in wide] == [t[:3] for t, _ in half]


def test_without_the_c_kernel_float16_runs_onednn_on_a_float32_copy(folder, monkeypatch):
    kind, path, _ = folder
    reference = run(LLM(str(path), **ENGINE))
    monkeypatch.setenv("INFLIGHT_FLOAT_GEMM", "onednn")
    llm = LLM(str(path), **ENGINE)
    model = llm.engine.runner.model
    assert not float_layers(llm) and isinstance(model.layers[0].mlp.down_proj, PackedLinear)
    widened = kind == "F16" or not onednn_caps.runs_bf16()  # (bfloat16 too where oneDNN has no bf16 GEMM: AVX2)
    assert model.layers[0].mlp.down_proj.dtype == (torch.float32 if widened else torch.bfloat16)
    assert llm.engine.runner.decode_path.native is None  # the Python layers
    answers = run(llm)
    assert [t[:3] for t, _ in answers] == [t[:3] for t, _ in reference]
    assert len(answers) == len(PROMPTS) and all(len(t) == PARAMS.max_tokens for t, _ in answers)


def test_only_a_gguf_float_file_keeps_its_type_under_auto():
    cpu = torch.device("cpu")
    assert resolve_dtype("auto", "float16", cpu, keep_on_cpu=True) == torch.float16
    assert resolve_dtype("auto", "bfloat16", cpu, keep_on_cpu=True) == torch.bfloat16
    assert resolve_dtype("auto", "float32", cpu, keep_on_cpu=True) == torch.float32
    assert resolve_dtype("auto", "bfloat16", cpu) == torch.float32  # a Hugging Face bf16 checkpoint
    assert resolve_dtype("float32", "float16", cpu, keep_on_cpu=True) == torch.float32


def test_the_onednn_callback_where_forced(folder, monkeypatch):
    """INFLIGHT_FLOAT_ONEDNN_FROM=16: a BF16 file's prompt steps (16 to 24 rows) run oneDNN's bf16 GEMM
    on the same tensor, called back from the stack; an F16 file's too, on oneDNN's fp16 GEMM where it
    has one (AVX512-FP16: a Sapphire Rapids Xeon), else on its float32 GEMM on the weight widened a slice
    at a time (an AMD EPYC), unless ONEDNN_MAX_CPU_ISA caps oneDNN below AVX-512 (then float_gemm.c).
    A BF16 file's on an AVX2-only CPU (no bf16 GEMM in oneDNN) widens the same way. Bit for bit either way."""
    kind, path, _ = folder
    monkeypatch.setenv("INFLIGHT_FLOAT_ONEDNN_FROM", "16")
    llm = LLM(str(path), **ENGINE)
    down, rows = llm.engine.runner.model.layers[1].mlp.down_proj, []
    onednn = kind == "BF16" or onednn_caps.runs_fp16() or onednn_caps.max_isa_allows("AVX512")
    assert down.widen == ((kind == "F16" and onednn and not onednn_caps.runs_fp16())
                          or (kind == "BF16" and not onednn_caps.runs_bf16()))  # an AVX2-only CPU's bf16
    assert down.onednn_from == (16 if onednn else 0)
    monkeypatch.setattr(down, "onednn", lambda x, f=down.onednn: rows.append(x.shape[0]) or f(x))
    assert_the_stack_matches_the_python_layers(llm)
    assert (min(rows) >= 16) if onednn else not rows
