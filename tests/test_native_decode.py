"""The CPU engine's steps through one C call for the layer stack (backend/worker/native_decode.py,
kernels/cpu/decode_stack.py) give exactly the Python layers' results: the same greedy tokens and
the same log-probabilities, to the bit, in every kind of step (prefill chunks, later chunks over
cached context, mixed steps of decode rows and a chunk, decode steps: issue 47), on every model
shape it takes (GQA, q/k/v biases, Qwen3's
head norms, a sliding window shorter than the contexts, Gemma 3's GeGLU, sandwich norms and two
KV-cache groups, fused projections of mixed packed types, K-quants, float32 and bfloat16 weights
(float_gemm.c, issue 47; the AVX2 build forced too; oneDNN called back where it is the faster)
and float tensors beside packed ones, float32 and bfloat16 caches,
mixtures of experts (the router and moe_block.c in the C loop; a block it does not take called back),
with prompts that are not block multiples in a batch of mixed lengths; with LoRA on, a batch
with an adapter's rows too (the deltas called back). Models it does not take keep the Python layers, and say
why; bad step tensors are refused by name."""
import logging
import re

import pytest
import torch

from backend import LLM, SamplingParams
from backend.models.float_linear import FloatLinear
from backend.worker import native_decode
from gguf_files import ALL_TYPES, K_SHAPE, K_TYPES
from hf_checkpoints import make_checkpoint
from test_quantized_engine import packed_folder

PROMPTS = [[5, 9, 200, 31, 7, 120, 44], [3, 60, 70, 8, 90, 11, 50, 17, 2, 33, 4, 150, 19, 81, 27, 36, 12, 66, 99],
           list(range(3, 43))]  # 7, 19 and 40 tokens: no block multiple (blocks of 16)
PARAMS = SamplingParams(max_tokens=14, temperature=0, ignore_eos=True, logprobs=3)
MIXED_TYPES = ("Q8_0", "F16", "F16", "F16", "Q4_0", "BF16", "BF16")


@pytest.fixture(scope="module")
def tiny_tokenizer_json(tmp_path_factory):
    from backend.models.make_model import make_model
    return make_model(tmp_path_factory.mktemp("tok")) / "tokenizer.json"


CASES = {
    "llama (GQA 4:1), bf16 cache": ("llama", {}, {}),
    "llama, float32 cache": ("llama", {}, {"kv_cache_dtype": "float32"}),
    "qwen2 (q/k/v biases)": ("qwen2", {}, {}),
    "qwen3 (q/k head norms)": ("qwen3", {}, {}),
    "mistral (a window of 11)": ("mistral", {"sliding_window": 11}, {}),
    "gemma3 (GeGLU, sandwich norms, local layers of a window of 13 beside global ones)": ("gemma3", {}, {}),
    "gguf, q/k/v and gate/up of mixed types": ("gguf", {"types": ALL_TYPES[3:]}, {}),
    "gguf qwen2, mixed types and biases": ("gguf", {"types": ALL_TYPES[3:], "arch": "qwen2"}, {}),
    "gguf, K-quants": ("gguf", {"types": K_TYPES, "shape": K_SHAPE, "tied": False}, {}),
    # float weights (issue 47): float_gemm.c's GEMMs, float32 or bfloat16 (vdpbf16ps where the CPU has it)
    "llama, float32 weights": ("llama", {}, {"quantization": "none"}),
    "llama, bfloat16 weights": ("llama", {}, {"quantization": "none", "dtype": "bfloat16"}),
    "qwen3, float32 weights": ("qwen3", {}, {"quantization": "none"}),
    "qwen3, bfloat16 weights": ("qwen3", {}, {"quantization": "none", "dtype": "bfloat16"}),
    "gemma3, float32 weights": ("gemma3", {}, {"quantization": "none"}),
    "gemma3, bfloat16 weights, float32 cache": ("gemma3", {}, {"quantization": "none", "dtype": "bfloat16",
                                                                "kv_cache_dtype": "float32"}),
    # a GGUF of float and packed tensors: q/k/v F16, o Q4_0, gate/up BF16, down and the embedding Q8_0
    # (the types go round the matrices, seven a layer), the float ones held as bfloat16
    "gguf, F16/BF16 tensors beside packed ones": ("gguf", {"types": MIXED_TYPES}, {"dtype": "bfloat16"}),
    "mixtral (8 experts, top 2: the MoE block in C)": ("mixtral", {}, {}),
    "qwen3-moe (a dense layer between MoE ones, no top-k renormalization)": ("qwen3_moe", {}, {}),
}


def engine(case: str, tmp_path, tokenizer_json) -> LLM:
    arch, model_args, engine_args = CASES[case]
    engine_args = dict(engine_args)
    if arch == "gguf":
        path, quantization = packed_folder(tmp_path, tokenizer_json, **model_args), "auto"
    else:
        path = make_checkpoint(arch, tmp_path / arch, seed=3, **model_args)
        quantization = engine_args.pop("quantization", "int8")
    # no prefix reuse: the second run's prompts then compute as the first's did; 24 tokens a step:
    # the 40-token prompt is cut into chunks (none a block multiple), the later ones beside the
    # others' decode rows (no pacing, whose cap follows measured step times: the same steps each run)
    return LLM(str(path), quantization=quantization, kv_block_size=16, max_num_seqs=4, max_model_len=128,
               enable_kv_cache_reuse=False, max_num_batched_tokens=24, inter_token_target_ms=0, **engine_args)


def run(llm: LLM) -> list:
    return [(o.token_ids, [{t: lp.logprob for t, lp in step.items()} for step in o.logprobs])
            for o in llm.generate(PROMPTS, PARAMS)]


@pytest.mark.parametrize("case", list(CASES))
def test_the_c_stack_gives_the_python_layers_results_bit_for_bit(case, tmp_path, tiny_tokenizer_json):
    llm = engine(case, tmp_path, tiny_tokenizer_json)
    if "weights" in case and "gguf" not in case:  # float checkpoints: float_gemm.c's in both paths
        proj = llm.engine.runner.model.layers[0].self_attn.qkv_proj
        assert isinstance(proj, FloatLinear) and proj.weight.dtype == (
            torch.bfloat16 if "bfloat16 weights" in case else torch.float32)
    if "beside packed" in case:  # both kinds of matrix in one model's stack
        attn = llm.engine.runner.model.layers[0].self_attn
        assert isinstance(attn.qkv_proj, FloatLinear) and attn.qkv_proj.weight.dtype == torch.bfloat16
        assert type(attn.o_proj).__name__ == "QuantLinear"
    if "moe" in case or "mixtral" in case:  # the router and moe_block.c in the C loop, no call back
        stack = llm.engine.runner.decode_path.native
        run(llm)
        assert stack._stack._ops.moe and not stack._stack._ops.mlp
        assert all(layer.moe is not None for layer in stack._stack._keep if layer.down is None)
    assert_the_stack_matches_the_python_layers(llm)


def assert_the_stack_matches_the_python_layers(llm: LLM) -> None:
    runner = llm.engine.runner
    stack = runner.decode_path.native
    assert stack is not None, native_decode.unsupported(runner.model, runner.ops.name, None)
    calls = []  # each step's (rows, decode rows)
    runner.decode_path.native = lambda *a: calls.append((a[0].shape[0], a[2].num_decode_tokens)) or stack(*a)
    native = run(llm)
    kinds = {"prefill" if nd == 0 else "decode" if nd == t else "mixed" for t, nd in calls}
    assert kinds == {"prefill", "mixed", "decode"}, str(calls)  # every kind of step ran in C
    assert len(calls) >= PARAMS.max_tokens + 1 and (len(PROMPTS), len(PROMPTS)) in calls  # decode steps batched
    runner.decode_path.native = None
    python = run(llm)
    runner.decode_path.native = stack
    assert native == python
    assert llm.engine.blocks.num_held == 0
    llm.check_integrity()


@pytest.fixture
def fresh_builds():
    from kernels.cpu import float_gemm, quant
    quant.chosen_isa.cache_clear()
    float_gemm.chosen_isa.cache_clear()
    yield
    quant.chosen_isa.cache_clear()
    float_gemm.chosen_isa.cache_clear()


@pytest.mark.parametrize("case", ["llama, bfloat16 weights", "qwen3, float32 weights",
                                  "gguf, F16/BF16 tensors beside packed ones"])
def test_with_the_avx2_build_forced_too(case, tmp_path, tiny_tokenizer_json, monkeypatch, fresh_builds):
    """INFLIGHT_CPU_ISA=avx2, as the packed kernels' tests force their AVX2 build: the float GEMMs
    run their AVX2 build (bfloat16 widened to float32, no vdpbf16ps), bit for bit in both paths."""
    monkeypatch.setenv("INFLIGHT_CPU_ISA", "avx2")
    llm = engine(case, tmp_path, tiny_tokenizer_json)
    kernels = [m.kernel for m in llm.engine.runner.model.modules() if isinstance(m, FloatLinear)]
    assert kernels and {k.isa for k in kernels} == {"avx2"}
    assert_the_stack_matches_the_python_layers(llm)


def test_steps_where_onednn_is_faster_call_it_back_from_the_stack(tmp_path, tiny_tokenizer_json, monkeypatch):
    """INFLIGHT_FLOAT_ONEDNN_FROM=16: the prompt steps' float projections (16 to 24 rows) run oneDNN
    in the Python layers, so the stack calls those modules back for them; the decode steps (4 rows
    at most) stay on float_gemm.c. Still bit for bit."""
    monkeypatch.setenv("INFLIGHT_FLOAT_ONEDNN_FROM", "16")
    llm = engine("qwen3, bfloat16 weights", tmp_path, tiny_tokenizer_json)
    down, rows = llm.engine.runner.model.layers[1].mlp.down_proj, []
    assert isinstance(down, FloatLinear) and down.onednn_from == 16
    monkeypatch.setattr(down, "onednn", lambda x, f=down.onednn: rows.append(x.shape[0]) or f(x))
    assert_the_stack_matches_the_python_layers(llm)
    assert rows and min(rows) >= 16  # called (from the stack and from the Python layers), and only there



@pytest.fixture(scope="module")
def llama(tmp_path_factory, tiny_tokenizer_json):
    llm = engine("llama (GQA 4:1), bf16 cache", tmp_path_factory.mktemp("llama"), tiny_tokenizer_json)
    run(llm)  # the stack is made at the first decode step
    return llm


@pytest.mark.parametrize("why,arch,env", [
    # float weights kept on oneDNN's GEMMs (the benchmarks' A/B): float32, and beside the experts
    ("PackedLinear weights, not ones the C kernels take", "llama", {"INFLIGHT_FLOAT_GEMM": "onednn"}),
    ("PackedLinear weights, not ones the C kernels take", "mixtral", {"INFLIGHT_FLOAT_GEMM": "onednn"}),
])
def test_models_it_does_not_take_keep_the_python_layers_and_say_why(why, arch, env, tmp_path, caplog, monkeypatch):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with caplog.at_level(logging.INFO, logger="backend.worker.fast_paths"):
        llm = LLM(str(make_checkpoint(arch, tmp_path / arch, seed=3)), kv_block_size=16, max_model_len=64)
    assert llm.engine.runner.decode_path.native is None
    assert any(why in r.getMessage() and "the Python layers" in r.getMessage() for r in caplog.records)
    assert llm.generate([PROMPTS[0]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))[0].token_ids


def test_it_can_be_turned_off(tmp_path, tiny_tokenizer_json, monkeypatch):
    monkeypatch.setenv("INFLIGHT_NATIVE_DECODE", "0")
    assert engine("llama (GQA 4:1), bf16 cache", tmp_path, tiny_tokenizer_json).engine.runner.decode_path.native is None


def test_bad_step_tensors_are_refused_by_name(llama):
    stack = llama.engine.runner.decode_path.native._stack
    t, hidden, blocks = 2, stack.hidden, stack.num_blocks
    x = torch.zeros(t, hidden)
    positions = torch.tensor([3, 4])
    slots = torch.tensor([[3, 4]])
    tables = torch.zeros(1, t, 2, dtype=torch.int32)
    lens = torch.tensor([4, 5], dtype=torch.int32)
    out = stack(x, positions, slots, tables, lens)  # the good call
    assert out.shape == (t, hidden) and torch.isfinite(out).all()
    bad = {
        "positions": (x, torch.tensor([3, stack.max_pos]), slots, tables, lens),
        "slots": (x, positions, torch.tensor([[3, blocks * stack.block_size]]), tables, lens),
        "block ids": (x, positions, slots, torch.full((1, t, 2), blocks, dtype=torch.int32), lens),
        "seq_lens": (x, positions, slots, tables, torch.tensor([4, 2 * stack.block_size + 1], dtype=torch.int32)),
        "x must be": (torch.zeros(t, hidden + 1), positions, slots, tables, lens),
        "tables must be": (x, positions, slots, tables.long(), lens),
    }
    for name, args in bad.items():
        with pytest.raises(ValueError, match=name):
            stack(*args)


@pytest.mark.slow  # PEFT writes the adapter: ~3 s
def test_with_lora_on_steps_with_adapter_rows_run_in_c_with_their_deltas_called_back(tmp_path):
    from lora_adapters import AdapterSpec, make_adapter
    base = make_checkpoint("llama", tmp_path / "base", seed=3)
    adapter = make_adapter(base, tmp_path / "a", seed=1, spec=AdapterSpec(r=8, alpha=16, b_std=0.1))
    llm = LLM(str(base), quantization="int8", kv_block_size=16, max_num_seqs=4, max_model_len=128,
              enable_kv_cache_reuse=False, enable_lora=True, max_loras=1, lora_modules=f"a={adapter}")
    path = llm.engine.runner.decode_path
    stack, calls = path.native, []
    assert stack is not None
    path.native = lambda *a: calls.append((a[0].shape[0], a[2].num_decode_tokens)) or stack(*a)
    mixed = [None, "a", None]

    def both():
        return (run(llm), [(o.token_ids, o.cumulative_logprob)
                           for o in llm.generate(PROMPTS, SamplingParams(max_tokens=9, temperature=0, ignore_eos=True,
                                                                         logprobs=0), lora_request=mixed)])
    native = both()
    assert calls.count((len(PROMPTS), len(PROMPTS))) >= 2 * (9 - 1)  # both batches decoded in C
    assert (sum(map(len, PROMPTS)), 0) in calls  # and prefilled
    path.native = None
    python = both()
    assert native == python
    base_answer, adapter_answer = native[0][1][0][:9], native[1][1][0]
    assert adapter_answer != base_answer  # the adapter's row ran with its deltas (same prompt, other tokens)


def test_a_routers_onednn_rows_are_called_back(tmp_path, tiny_tokenizer_json, monkeypatch):
    """A MoE layer's router is a projection of the stack: where oneDNN is the faster for a step's rows
    (forced here from 16 rows, so the 24-token prompt steps reach it) the stack calls the module back,
    as for any float projection; bit for bit the Python layers' results either way."""
    from backend.models.moe import moe_blocks
    monkeypatch.setenv("INFLIGHT_FLOAT_ONEDNN_FROM", "16")
    llm = engine("qwen3-moe (a dense layer between MoE ones, no top-k renormalization)", tmp_path, tiny_tokenizer_json)
    gate, rows = moe_blocks(llm.engine.runner.model)[0].gate, []
    assert isinstance(gate, FloatLinear) and gate.onednn_from == 16
    monkeypatch.setattr(gate, "onednn", lambda x, f=gate.onednn: rows.append(x.shape[0]) or f(x))
    assert_the_stack_matches_the_python_layers(llm)
    assert rows and min(rows) >= 16


def test_an_error_in_a_called_back_moe_block_is_raised_by_the_stack(tmp_path, tiny_tokenizer_json, monkeypatch):
    """Experts that moe_block.c does not take (here all, as if) are the Python block's, called back;
    the C loop cannot pass a Python exception through: the stack keeps it, stops, and raises it
    once C returns; the next call runs normally."""
    from backend.models.moe import SparseMoeBlock
    monkeypatch.setattr(SparseMoeBlock, "cpu_moe", lambda self: None)
    llm = engine("mixtral (8 experts, top 2: the MoE block in C)", tmp_path, tiny_tokenizer_json)
    run(llm)  # the stack is made at the first decode step
    stack = llm.engine.runner.decode_path.native._stack
    assert stack._ops.mlp and not stack._ops.moe
    args = (torch.zeros(2, stack.hidden), torch.tensor([3, 4]), torch.tensor([[3, 4]]),
            torch.zeros(1, 2, 2, dtype=torch.int32), torch.tensor([4, 5], dtype=torch.int32))
    good = stack(*args)
    layer = stack._keep[1]
    block = layer.mlp

    def broken(h, lora=None):
        raise RuntimeError("expert 3 is on fire")
    layer.mlp = broken
    with pytest.raises(RuntimeError, match="expert 3 is on fire"):
        stack(*args)
    layer.mlp = block
    assert torch.equal(stack(*args), good)


def test_steps_with_an_images_rows_run_the_python_layers(llama, monkeypatch, caplog):
    """An image's placeholder rows attend both ways within the image (attention.py's torch pass):
    such a step leaves the C loop for the Python layers, said once in the log; the others stay in C."""
    runner = llama.engine.runner
    native, made = runner.decode_path.native, runner.metadata.for_step
    fallback, in_c = [], []
    python_layers, stack = native._python_layers, native._stack

    def marked(*args, **kwargs):  # every step with prompt rows is marked as if it had an image
        ctx = made(*args, **kwargs)
        ctx.image_spans = ["an image"] if ctx.num_decode_tokens < ctx.slot_mapping.shape[1] else []
        return ctx

    def spied(x, positions, ctx, rope):  # the marks taken off again: the Python attention ignores them
        fallback.append(x.shape[0])
        ctx.image_spans = []
        return python_layers(x, positions, ctx, rope)
    monkeypatch.setattr(runner.metadata, "for_step", marked)
    monkeypatch.setattr(native, "_python_layers", spied)
    monkeypatch.setattr(native, "_stack", lambda x, *a, **kw: in_c.append(x.shape[0]) or stack(x, *a, **kw))
    monkeypatch.setattr(native, "_made_for", native._made_for)
    with caplog.at_level(logging.INFO, logger="backend.worker.native_decode"):
        marked_run = run(llama)
    assert fallback and sum(fallback) >= sum(map(len, PROMPTS)) and in_c  # prompt steps in Python, decodes in C
    assert "an image's placeholder rows: the Python layers" in caplog.text
    monkeypatch.setattr(runner.metadata, "for_step", made)
    assert run(llama) == marked_run  # the same results either way


def test_bad_prompt_rows_are_refused_by_name(llama):
    stack = llama.engine.runner.decode_path.native._stack
    x, positions = torch.zeros(3, stack.hidden), torch.tensor([4, 0, 1])
    decode = (torch.tensor([[4, 16, 17]]), torch.zeros(1, 1, 2, dtype=torch.int32),
              torch.tensor([5], dtype=torch.int32))
    chunk = (torch.tensor([0, 2], dtype=torch.int32), torch.ones(1, 1, 2, dtype=torch.int32),
             torch.tensor([2], dtype=torch.int32))
    out = stack(x, positions, *decode, None, chunk)  # the good call: a decode row, then a 2-token chunk
    assert out.shape == (3, stack.hidden) and torch.isfinite(out).all()
    bad = {
        "cu_seqlens_q must rise from 0 to the 2 query rows": (torch.tensor([0, 3], dtype=torch.int32), *chunk[1:]),
        "a chunk is longer than its sequence's seq_lens": (*chunk[:2], torch.tensor([1], dtype=torch.int32)),
        "decode_stack (the prompt rows): block ids": (chunk[0], torch.full((1, 1, 2), stack.num_blocks,
                                                                           dtype=torch.int32), chunk[2]),
        "the prompt rows' tables must be": (chunk[0], torch.ones(1, 2, dtype=torch.int32), chunk[2]),
    }
    for message, prompt in bad.items():
        with pytest.raises(ValueError, match=re.escape(message)):
            stack(x, positions, *decode, None, prompt)
    with pytest.raises(ValueError, match="seq_lens must be"):  # prompt rows with no chunks to say where they are
        stack(x, positions, *decode)
