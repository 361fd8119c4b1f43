"""Tensor-parallel ranks on the C layer stack (issue 47): each rank runs its shard of the stack in C
and all-reduces the attention output's and the MLP's partial sums where the Python layers do, by
the same means (the group's shared memory, in C: kernels/cpu/shm_reduce.py; the group's all_reduce
called back otherwise). TP=1 is the oracle of TP=2 (greedy tokens equal, prefill, mixed and decode
steps all in C); the TP=2 stack's hidden states are the TP=2 Python layers' to the bit, whichever
way it reduces, a mixture of experts' block (called back) summed by the stack too; every rank's path is gathered at start, so a rank on the Python layers is named;
and the C all-reduce and the Python one interleave on one segment with the same bits."""
import logging
import os
import signal
import threading

import numpy as np
import pytest
import torch

from backend import LLM
from backend.models.make_model import make_model
from backend.worker import native_decode
from backend.worker.parallel import shm
from kernels.cpu.shm_reduce import PYTHON_PATH, STOPPED, SUMMED
from tp_helpers import greedy, random_prompts, tp_workers

SLOT = 1 << 14  # bytes: 4,096 floats a slot


# -- the C all-reduce against shm.py's Python one, on one segment --------------------------------------

def _segment(size: int):
    ranks = [shm.ShmCollectives(shm.new_segment_name(), 0, size, lambda: None, create=True, slot_bytes=SLOT)]
    ranks += [shm.ShmCollectives(ranks[0].path.name, r, size, lambda: None, slot_bytes=SLOT) for r in range(1, size)]
    ranks[0].unlink()
    return ranks


def _run_ranks(ranks, work):
    """work(rank, segment) on one thread per rank (ctypes lets the others run while C waits)."""
    results, errors = [None] * len(ranks), []

    def one(r):
        try:
            results[r] = work(r, ranks[r])
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(r,)) for r in range(len(ranks))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return results


@pytest.mark.parametrize("size", [2, 3])
def test_c_and_python_all_reduces_interleave_on_one_segment_with_the_same_bits(size):
    """Each rank alternates C and Python operations out of step with the others (rank r takes C on
    operations i + r even); every result is (a + b) + c in rank order, as shm.py sums, on every rank."""
    gen = torch.Generator().manual_seed(3)
    lengths = [1, 577, 4096, 3, 1000, 2049, 64, 4095] * 2  # floats: none a multiple of the others
    inputs = [[torch.randn(n, generator=gen) * 10 ** (i % 5) for n in lengths] for i in range(size)]
    expected = []
    for i in range(len(lengths)):
        total = torch.add(inputs[0][i], inputs[1][i])
        for r in range(2, size):
            total.add_(inputs[r][i])
        expected.append(total)

    def work(r, segment):
        out = []
        for i, x in enumerate(inputs[r]):
            x = x.clone()
            if (i + r) % 2 == 0:
                assert segment.native()(x) == SUMMED
            else:
                segment.all_reduce(x)
            out.append(x)
        return out

    ranks = _segment(size)
    try:
        results = _run_ranks(ranks, work)
        assert ranks[0].native().stats()[0] == len(lengths) // 2
    finally:
        for segment in ranks:
            segment.close()
    for r in range(size):
        for i, got in enumerate(results[r]):
            assert torch.equal(got, expected[i]), (r, i)


def test_the_c_all_reduce_hands_what_it_cannot_sum_back_unchanged():
    """Larger than a slot (gloo's, in the group), a closed or failed group while waiting (the Python
    side then raises why), a segment unmapped; and a tensor it does not take is refused by name."""
    zero, one = _segment(2)
    try:
        big = torch.ones(SLOT // 4 + 1)
        assert zero.native()(big) == PYTHON_PATH and torch.equal(big, torch.ones_like(big))
        x = torch.full((10,), 2.0)
        one.fail()  # rank 1's group lost a rank; rank 0 never comes
        assert one.native()(x) == STOPPED and torch.equal(x, torch.full((10,), 2.0))
        with pytest.raises(ValueError, match="shm_reduce: the tensor must be a contiguous float32 CPU tensor"):
            zero.native()(torch.ones(4, dtype=torch.float64))
        with pytest.raises(ValueError, match="contiguous float32"):
            zero.native()(torch.ones(4, 2).t())
        zero.close()  # rank 0 closes: rank 1's waits stop, and rank 0's C side is detached
        assert zero.native()(x) == PYTHON_PATH
    finally:
        zero.close()
        one.close()
    fresh, other = _segment(2)
    try:
        fresh._ctrl[2, 0] = 1  # the closed flag, as rank 0's close sets it
        assert other.native()(torch.ones(3)) == STOPPED
    finally:
        fresh.close()
        other.close()


# -- engines: TP=2 on the C stack ------------------------------------------------------------------

@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The tests' random Llama (8 heads of 32, 2 KV heads) with an MLP of 768: at TP=2 each rank's
    down_proj takes 384 inputs, whole groups of 32, so every projection is Q8_0 (quantization=int8)."""
    return make_model(tmp_path_factory.mktemp("tp-native"), seed=2, intermediate_size=768)


def _engine(model_dir, tp: int, quantization: str = "int8") -> LLM:
    # prompts of 3-44 tokens in steps of 24: prefill chunks, mixed steps and decode steps
    return LLM(str(model_dir), quantization=quantization, max_model_len=256, max_num_batched_tokens=24,
               inter_token_target_ms=0, enable_kv_cache_reuse=False, tensor_parallel_size=tp)


def _run(llm: LLM, prompts, params, hidden: list) -> list:
    """The outputs, with the hidden states rank 0's LM head reads appended to `hidden`."""
    model = llm.engine.runner.model
    logits = model.logits
    model.logits = lambda h: hidden.append(h.clone()) or logits(h)
    try:
        outs = llm.generate(prompts, params)
    finally:
        del model.logits
    return [(o.token_ids, [{t: lp.logprob for t, lp in s.items()} for s in o.logprobs]) for o in outs]


@pytest.mark.slow
def test_tp2_on_the_c_stack_of_every_rank_gives_one_rank_s_tokens(model_dir):
    """Packed weights quantize each projection's input to int8 per group of 32 (as llama.cpp), so the
    all-reduce's summation order (~1e-6) can flip a near tie, in the Python layers as in C
    (docs/parallelism.md; the next test shows the two TP=2 paths equal to the bit): tokens equal,
    or they part where one rank's top two are under 0.25 apart, the TP=2 token one of them."""
    prompts, params = random_prompts(6, seed=5), greedy(10, logprobs=2)
    with _engine(model_dir, 1) as one:
        assert one.engine.runner.decode_path.native is not None
        expected = one.generate(prompts, params)
    with _engine(model_dir, 2) as two:
        runner = two.engine.runner
        assert runner.decode_path.native_ranks == [True, True]  # rank 1's own choice, gathered at start
        stack, kinds = runner.decode_path.native, set()
        runner.decode_path.native = lambda x, p, ctx, rope: kinds.add(
            "decode" if ctx.num_decode_tokens == x.shape[0] else "prefill" if not ctx.num_decode_tokens
            else "mixed") or stack(x, p, ctx, rope)
        got = two.generate(prompts, params)
        runner.decode_path.native = stack
        assert kinds == {"prefill", "mixed", "decode"}
        calls, layers = runner.tp.stats()["calls"], runner.model_cfg.num_layers
        assert calls["all_reduce"] == calls["step_message"] * (2 * layers + 1)  # the C ones counted too
        assert stack.shm.stats()[0] == calls["step_message"] * 2 * layers  # every layer's, in C
    same = 0
    for a, b in zip(expected, got):
        if a.token_ids == b.token_ids:
            same += 1
            continue
        i = next(i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y)
        top_two = {t: lp.logprob for t, lp in a.logprobs[i].items()}
        assert b.token_ids[i] in top_two and abs(np.subtract(*top_two.values())) < 0.25, (i, top_two, b.token_ids)
    assert same >= 5, f"{same} of 6 prompts agree"
    assert not tp_workers()


@pytest.mark.slow
@pytest.mark.parametrize("reduction", ["shared memory", "gloo"])
def test_tp2_c_stack_hidden_states_are_the_python_layers_bits(model_dir, monkeypatch, reduction):
    """The same kernels in the same order on each rank, the same sums (a + b for two ranks): bit for
    bit, log-probabilities and hidden states, the C stack against the Python layers of a group that
    reduces the same way: on the group's shared memory (the C stack summing in C, and calling the
    Python side back with INFLIGHT_TP_SHM=python: one run of the Python layers is the oracle of
    both, INFLIGHT_TP_SHM=python changing nothing there), or with gloo (INFLIGHT_TP_SHM=0)."""
    prompts, params = random_prompts(4, seed=9), greedy(8, logprobs=3)
    if reduction == "gloo":
        monkeypatch.setenv("INFLIGHT_TP_SHM", "0")
    with monkeypatch.context() as off:
        off.setenv("INFLIGHT_NATIVE_DECODE", "0")
        with _engine(model_dir, 2) as llm:
            assert llm.engine.runner.decode_path.native_ranks == [False, False]
            assert (llm.engine.runner.tp.shm is None) == (reduction == "gloo")
            python_hidden = []
            python = _run(llm, prompts, params, python_hidden)
    for env in ["INFLIGHT_TP_SHM=0"] if reduction == "gloo" else ["", "INFLIGHT_TP_SHM=python"]:
        with monkeypatch.context() as way:
            if env:
                way.setenv(*env.split("="))
            with _engine(model_dir, 2) as llm:
                native_path = llm.engine.runner.decode_path
                assert native_path.native_ranks == [True, True]
                assert (native_path.native.shm is None) == bool(env)
                native_hidden = []
                native = _run(llm, prompts, params, native_hidden)
        assert native == python, env
        assert len(native_hidden) == len(python_hidden), env
        assert all(torch.equal(a, b) for a, b in zip(native_hidden, python_hidden)), env


@pytest.mark.slow
def test_a_rank_killed_while_rank_0_waits_in_c_fails_the_requests_naming_it(model_dir):
    """Rank 0's C all-reduce stops waiting when the group learns a rank is gone (shm.fail), and the
    Python side raises the group's reason, as on the Python layers."""
    from backend.core.config import EngineConfig
    from backend.core.errors import EngineDeadError
    from backend.engine.async_engine import AsyncEngine

    engine = AsyncEngine(EngineConfig(model_path=str(model_dir), quantization="int8", max_model_len=512,
                                      tensor_parallel_size=2))
    finals, done, first = {}, threading.Event(), threading.Event()

    def sink(out):
        if out.new_token_ids:
            first.set()
        if out.finished:
            finals[out.request_id] = out
            if len(finals) == 2:
                done.set()

    try:
        assert engine.engine.runner.decode_path.native_ranks == [True, True]
        for i in range(2):
            engine.add_request(f"r{i}", [5, 6, 7, i + 8], greedy(400), sink)
        assert first.wait(60)
        worker = engine.engine.runner.tp.workers.procs[1]
        os.kill(worker.pid, signal.SIGKILL)
        assert done.wait(30)
        for out in finals.values():
            assert out.finish_reason == "error" and len(out.token_ids) < 400
            assert f"tensor-parallel rank 1 (pid {worker.pid}) was killed by signal 9 (SIGKILL)" in out.error
        with pytest.raises(EngineDeadError, match="rank 1"):
            engine.add_request("late", [5, 6], greedy(4), sink)
    finally:
        engine.shutdown()
    assert not tp_workers()


@pytest.mark.slow
def test_tp2_c_stack_with_a_mixture_of_experts_is_the_python_layers_bits(tmp_path, monkeypatch):
    """Float Mixtral (float_gemm.c for attention, the MoE block called back from C): the block's partial
    output is summed by the stack's all-reduce, as RowParallel sums the whole block in Python."""
    from hf_checkpoints import make_checkpoint

    path = make_checkpoint("mixtral", tmp_path / "mixtral", seed=2)
    prompts, params = random_prompts(4, seed=9, vocab=512), greedy(8, logprobs=3)
    hidden = {}
    for native in ("0", "1"):
        monkeypatch.setenv("INFLIGHT_NATIVE_DECODE", native)  # the workers inherit it
        with _engine(path, 2, quantization="none") as llm:
            assert llm.engine.runner.decode_path.native_ranks == [native == "1"] * 2
            hidden[native] = []
            hidden[native + " outputs"] = _run(llm, prompts, params, hidden[native])
    assert hidden["1 outputs"] == hidden["0 outputs"]
    assert len(hidden["1"]) == len(hidden["0"]) and all(torch.equal(a, b) for a, b in zip(hidden["1"], hidden["0"]))


def test_rank_0_names_a_rank_that_took_the_python_layers(caplog):
    class Group:  # a TensorParallelGroup's gather, rank 1 having no C stack
        rank, size = 0, 3

        @staticmethod
        def gather_ints(value):
            return [value, 0, value]

    class Stack:
        reduction = "the group's shared memory, in C"

    with caplog.at_level(logging.INFO, logger="backend.worker.native_decode"):
        assert native_decode.native_ranks(Group, Stack) == [True, False, True]
        assert native_decode.native_ranks(Group, None) == [False, False, False]
    assert [r.getMessage() for r in caplog.records] == [
        "tensor-parallel ranks [1] run the Python layers, the others the C layer stack"]


@pytest.mark.slow
def test_tp_native_bench_measures_the_three_ways(model_dir, capsys):
    """client/tools/benchmarks/tp_native.py, the command behind docs/parallelism.md's figures: each way
    in its own processes, each checked to run on the path it names (the C stack on every rank, or none)."""
    from client.tools.benchmarks import tp_native
    assert tp_native.main(["--model", str(model_dir), "--batches", "1", "--steps", "3", "--prompt", "40",
                           "--rounds", "1"]) == 0
    rows = [line.strip("| ").split(" | ") for line in capsys.readouterr().out.splitlines()[-3:]]
    assert [r[1] for r in rows] == list(tp_native.WAYS)
    assert all(float(r[2]) > 0 and float(r[6]) > 0 for r in rows), rows
    assert rows[2][7] == "1.00x" and rows[2][8] == "1.00x"  # python against itself
