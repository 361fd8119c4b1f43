"""The threaded engine the server uses: streaming callbacks, aborts, queue limits, step faults."""
import threading
import time

import pytest

from backend import LLM, EngineConfig, SamplingParams
from backend.engine.async_engine import AsyncEngine
from backend.core.errors import QueueFullError


class Collector:
    def __init__(self):
        self.outputs = {}
        self.done = {}
        self.lock = threading.Lock()
        self.all_done = threading.Event()
        self.expected = 0

    def __call__(self, out):
        with self.lock:
            self.outputs.setdefault(out.request_id, []).append(out)
            if out.finished:
                assert out.request_id not in self.done, "two final outputs"
                self.done[out.request_id] = out
                if len(self.done) == self.expected:
                    self.all_done.set()


@pytest.fixture
def engine(default_model_dir):
    eng = AsyncEngine(EngineConfig(model_path=str(default_model_dir), max_num_seqs=8,
                                   max_tokens_in_paged_kv_cache=2048, max_queue_size=64))
    yield eng
    eng.shutdown()


def wait_idle(eng, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = eng.stats()
        if s["num_requests_running"] == 0 and s["num_requests_waiting"] == 0 and s["kv_blocks_used"] == 0:
            return s
        time.sleep(0.01)
    raise AssertionError(f"engine did not go idle: {eng.stats()}")


def test_streams_match_offline_generation(engine, default_model_dir):
    prompts = [f"request number {i} about batching" for i in range(12)]
    params = [SamplingParams(max_tokens=5 + 3 * i, temperature=0) for i in range(12)]
    sink = Collector()
    sink.expected = len(prompts)
    threads = [threading.Thread(target=engine.add_request, args=(f"r{i}", p, sp, sink))
               for i, (p, sp) in enumerate(zip(prompts, params))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sink.all_done.wait(60)
    expected = LLM(str(default_model_dir)).generate(prompts, params)
    for i, exp in enumerate(expected):
        steps = sink.outputs[f"r{i}"]
        streamed = [t for o in steps for t in o.new_token_ids]
        assert streamed == exp.token_ids == steps[-1].token_ids
        assert "".join(o.new_text for o in steps) == exp.text == steps[-1].text
        assert steps[-1].finish_reason == exp.finish_reason
    wait_idle(engine)


def test_abort_mid_stream_frees_blocks_and_ends_with_abort(engine):
    sink = Collector()
    sink.expected = 1
    started = threading.Event()

    def on_output(out):
        started.set()
        sink(out)

    engine.add_request("long", "a long story", SamplingParams(max_tokens=500, ignore_eos=True), on_output)
    assert started.wait(30)
    assert engine.stats()["kv_blocks_used"] > 0
    assert engine.abort("long")
    assert sink.all_done.wait(30)
    final = sink.done["long"]
    assert final.finish_reason == "abort" and len(final.token_ids) < 500
    wait_idle(engine)
    assert not engine.abort("long"), "aborting a finished request reports it unknown"


def test_duplicate_request_id_and_queue_full(default_model_dir):
    eng = AsyncEngine(EngineConfig(model_path=str(default_model_dir), max_num_seqs=1, max_queue_size=2))
    try:
        sink = Collector()
        sink.expected = 3
        params = SamplingParams(max_tokens=200, ignore_eos=True)
        eng.add_request("a", "one", params, sink)
        with pytest.raises(ValueError, match="request_id 'a' is already running"):
            eng.add_request("a", "again", params, sink)
        time.sleep(0.2)  # "a" is running; the queue takes two more
        eng.add_request("b", "two", params, sink)
        eng.add_request("c", "three", params, sink)
        with pytest.raises(QueueFullError, match="max_queue_size"):
            eng.add_request("d", "four", params, sink)
        for rid in "abc":
            eng.abort(rid)
        assert sink.all_done.wait(30)
        assert {o.finish_reason for o in sink.done.values()} == {"abort"}
        wait_idle(eng)
    finally:
        eng.shutdown()


def test_a_failing_step_fails_only_its_requests(engine, monkeypatch):
    runner = engine.engine.runner
    real_run = runner.execute
    calls = {"n": 0}

    def flaky(plan):
        calls["n"] += not plan.is_empty
        if calls["n"] == 2:
            raise RuntimeError("injected fault")
        return real_run(plan)

    monkeypatch.setattr(runner, "execute", flaky)
    sink = Collector()
    sink.expected = 1
    engine.add_request("victim", "x", SamplingParams(max_tokens=50, ignore_eos=True), sink)
    assert sink.all_done.wait(30)
    assert sink.done["victim"].finish_reason == "error"
    assert "injected fault" in sink.done["victim"].error
    wait_idle(engine)
    after = Collector()
    after.expected = 1
    engine.add_request("survivor", "y", SamplingParams(max_tokens=5, temperature=0), after)
    assert after.all_done.wait(30)
    assert after.done["survivor"].finish_reason in ("length", "stop")


def test_shutdown_finishes_every_request(default_model_dir):
    eng = AsyncEngine(EngineConfig(model_path=str(default_model_dir)))
    sink = Collector()
    sink.expected = 3
    for i in range(3):
        eng.add_request(f"s{i}", "z", SamplingParams(max_tokens=1000, ignore_eos=True), sink)
    eng.shutdown()
    assert sink.all_done.wait(10)
    assert {o.finish_reason for o in sink.done.values()} == {"abort"}


def test_the_engine_is_built_on_the_thread_that_steps_it(default_model_dir, monkeypatch):
    # torch keeps an OpenMP pool per calling thread: a model loaded on one thread and stepped on
    # another ran every step about 2x slower on 2 cores (docs/performance.md).
    from backend.engine import llm_engine as engine_module
    threads = {}
    build, step = engine_module.LLMEngine.__init__, engine_module.LLMEngine.core_step

    def recording_build(self, config):
        threads["build"] = threading.current_thread().name
        build(self, config)

    def recording_step(self):
        threads.setdefault("step", threading.current_thread().name)
        return step(self)

    monkeypatch.setattr(engine_module.LLMEngine, "__init__", recording_build)
    monkeypatch.setattr(engine_module.LLMEngine, "core_step", recording_step)
    eng = AsyncEngine(EngineConfig(model_path=str(default_model_dir), max_tokens_in_paged_kv_cache=512))
    try:
        got = Collector()
        got.expected = 1
        eng.add_request("r", [5, 6, 7], SamplingParams(max_tokens=2, temperature=0), got)
        assert got.all_done.wait(30)
    finally:
        eng.shutdown()
    assert threads["build"] == threads["step"] == "inflight-engine"
    # a build that fails raises in the caller, with the engine's own message
    with pytest.raises(ValueError, match="model_path is required"):
        AsyncEngine(EngineConfig(model_path=""))


def test_the_engine_thread_never_detokenizes_and_a_stop_string_costs_at_most_one_step(default_model_dir, monkeypatch):
    """Text is made on the output thread (backend/engine/output_processor.py); a stop string found
    there ends its sequence in the scheduler before the step after next (the engine thread never
    runs ahead of more than one step of outputs being made text)."""
    from backend.engine import core as core_module
    from backend.text import detokenizer

    reference = LLM(str(default_model_dir)).generate(
        ["a story about the sea"], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))[0]
    stop = reference.text[len(reference.text) // 3:len(reference.text) // 3 + 4]
    assert stop.strip() and stop in reference.text
    threads = set()
    add = detokenizer.IncrementalDetokenizer.add

    def recording_add(self, ids):
        threads.add(threading.current_thread().name)
        return add(self, ids)

    monkeypatch.setattr(detokenizer.IncrementalDetokenizer, "add", recording_add)
    from backend.engine.output_processor import OutputProcessor
    process = OutputProcessor.process

    def slow_process(self, outputs):  # making text slower than a step: the engine must not run ahead
        time.sleep(0.02)
        return process(self, outputs)

    monkeypatch.setattr(OutputProcessor, "process", slow_process)
    eng = AsyncEngine(EngineConfig(model_path=str(default_model_dir), max_num_seqs=8))
    ended = []
    finish = eng.engine.scheduler.finish

    def recording_finish(req, status):
        ended.append((req.request_id, status, len(req.output_token_ids)))
        finish(req, status)

    eng.engine.scheduler.finish = recording_finish
    try:
        sink = Collector()
        sink.expected = 6
        for i in range(5):  # company: steps of several rows
            eng.add_request(f"other{i}", f"filler {i}", SamplingParams(max_tokens=60, ignore_eos=True, seed=i), sink)
        eng.add_request("s", "a story about the sea", SamplingParams(max_tokens=40, temperature=0, ignore_eos=True,
                                                                     stop=[stop]), sink)
        assert sink.all_done.wait(60)
        wait_idle(eng)
    finally:
        eng.shutdown()
    out = sink.done["s"]
    assert out.finish_reason == "stop" and out.text == reference.text[:reference.text.index(stop)]
    delivered = len(out.token_ids)
    (rid, status, generated), = [e for e in ended if e[0] == "s"]
    assert status is core_module.RequestStatus.FINISHED_STOPPED
    assert delivered <= generated <= delivered + 1, (delivered, generated)  # at most one step more
    assert threads == {"inflight-output"}, threads
