"""Constraints compile off the request path (backend/engine/structured/compile_pool.py, waitlist.py): a
request with a new constraint waits, holding no KV and blocking nobody, while a worker process
compiles it; one that compiles past structured_outputs_compile_timeout_s is refused (its worker
killed) while a plain request beside it runs at its usual speed; a schema too deep is refused at
arrival; a compiling request is not the head of the queue, and aborting it leaks nothing."""
from __future__ import annotations

import itertools
import threading
import time
from concurrent.futures import Future

import pytest

from backend import LLM, EngineConfig, SamplingParams
from backend.engine.async_engine import AsyncEngine
from backend.core.request import RequestStatus
from backend.engine.structured.compile_pool import CompileFailed, CompileJob, CompilePool, GrammarCompilerBusy, shared_pool
from backend.engine.structured.compiler import ConstraintCompiler
from backend.core.structured import StructuredOutputs

pytestmark = pytest.mark.slow  # a grammar worker process starts (and is killed): seconds

# 800 optional properties: xgrammar's grammar for them grows quadratically; seconds to compile here
SLOW = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(800)}}
TIMEOUT_S = 0.5
_fresh = itertools.count()


def nested(depth: int) -> dict:
    schema = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


def fresh_regex() -> dict:
    """A constraint no cache has seen: it compiles (in ~10 ms) rather than being looked up."""
    return {"regex": f"x{next(_fresh)}[a-z]+"}


class Finals:
    def __init__(self):
        self.done: dict[str, tuple[float, object]] = {}
        self.cv = threading.Condition()

    def __call__(self, out):
        if out.finished:
            with self.cv:
                self.done[out.request_id] = (time.monotonic(), out)
                self.cv.notify_all()

    def wait(self, rid: str, timeout: float = 60.0):
        with self.cv:
            assert self.cv.wait_for(lambda: rid in self.done, timeout), f"{rid} never finished"
            return self.done[rid]


@pytest.fixture(scope="module")
def engine(default_model_dir):
    eng = AsyncEngine(EngineConfig(model_path=str(default_model_dir), max_model_len=256, max_num_seqs=8,
                                   max_tokens_in_paged_kv_cache=2048, structured_outputs_compile_timeout_s=TIMEOUT_S))
    eng.engine.grammars.warm_up().result(300)  # a worker is up: what follows times compiles alone
    yield eng
    eng.shutdown()


def test_a_schema_compiling_past_the_timeout_is_refused_while_a_plain_request_runs(engine):
    finals, killed = Finals(), shared_pool().num_killed
    start, cpu = time.monotonic(), time.thread_time()
    engine.add_request("slow", "x", SamplingParams(max_tokens=4, structured_outputs={"json": SLOW}), finals)
    # nothing compiled on the caller's thread (Triton's execute), nor waited for: its CPU time, which a
    # pause of the process does not lengthen, and the wall clock's, with room for one
    assert time.thread_time() - cpu < 0.2 and time.monotonic() - start < 1.0
    sent = time.monotonic()
    engine.add_request("plain", "hello there", SamplingParams(max_tokens=2, temperature=0.0), finals)
    plain_at, plain = finals.wait("plain")
    assert plain.finish_reason == "length" and plain_at - sent < 1.0, plain_at - sent
    assert "slow" not in finals.done  # still compiling when the plain one had finished
    slow_at, slow = finals.wait("slow")
    assert slow.finish_reason == "error" and slow.error_kind == "invalid"
    assert slow.error.startswith(f"structured_outputs.json: not compiled within {TIMEOUT_S:g} s "
                                 "(structured_outputs_compile_timeout_s)"), slow.error
    assert slow_at - start >= TIMEOUT_S and shared_pool().num_killed == killed + 1  # its worker was ended
    with pytest.raises(ValueError, match="not compiled within"):  # the refusal is remembered: no second compile
        engine.add_request("slow-again", "x", SamplingParams(max_tokens=4, structured_outputs={"json": SLOW}), finals)
    _idle(engine)


def test_a_schema_nested_too_deep_is_refused_at_arrival_naming_the_limit(engine):
    start, cpu = time.monotonic(), time.thread_time()
    with pytest.raises(ValueError, match=r"^structured_outputs.json: subschemas are nested more than 32 levels deep"):
        engine.add_request("deep", "x", SamplingParams(max_tokens=4, structured_outputs={"json": nested(60)}),
                           Finals())
    with pytest.raises(ValueError, match=r"^structured_outputs.json is nested more than 128 levels deep"):
        engine.add_request("deeper", "x", SamplingParams(max_tokens=4, structured_outputs={"json": nested(800)}),
                           Finals())  # the audit's 800 levels: 85 s of compiling before
    assert time.thread_time() - cpu < 0.1 and time.monotonic() - start < 1.0  # (room for a pause)
    finals = Finals()
    engine.add_request("ok", "x", SamplingParams(max_tokens=8, structured_outputs={"json": nested(3)}), finals)
    assert finals.wait("ok")[1].finish_reason in ("stop", "length")
    _idle(engine)


def test_a_compiling_request_waits_outside_the_queue_and_its_abort_leaks_nothing(default_model_dir):
    llm = LLM(str(default_model_dir), max_model_len=256, max_tokens_in_paged_kv_cache=64, enable_backfill=False)
    eng = llm.engine
    compiling = eng.add_request("c", "x", SamplingParams(max_tokens=40, structured_outputs=fresh_regex()))
    plain = eng.add_request("p", "hello", SamplingParams(max_tokens=40, temperature=0.0))
    # strict no-evict, room for one request: the compiling one arrived first and is not the head
    assert compiling.status is RequestStatus.WAITING_FOR_GRAMMAR and compiling not in eng.scheduler.waiting
    assert eng.stats()["num_requests_compiling"] == 1 and eng.stats()["num_requests_waiting"] == 2
    eng.step()
    assert plain.status is RequestStatus.RUNNING and eng.blocks.num_blocks_of("c") == 0
    gone = eng.add_request("gone", "x", SamplingParams(max_tokens=4, structured_outputs=fresh_regex()))
    (aborted,) = eng.abort("gone")
    assert aborted.finish_reason == "abort" and gone.status is RequestStatus.FINISHED_ABORTED
    finished = {}
    while eng.has_work():
        if not eng.has_runnable_work():
            eng.waitlist.wait(0.05)
        for out in eng.step():
            if out.finished:
                finished[out.request_id] = out
        eng.check_integrity()
    assert set(finished) == {"c", "p"} and finished["c"].finish_reason in ("stop", "length")
    assert compiling.first_scheduled_step > plain.first_scheduled_step
    assert eng.stats()["kv_blocks_used"] == 0 and not eng.waitlist


def _idle(engine, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = engine.stats()
        if s["num_requests_running"] == s["num_requests_waiting"] == s["kv_blocks_used"] == 0:
            return
        time.sleep(0.01)
    raise AssertionError(f"not idle: {engine.stats()}")



@pytest.fixture(scope="module")
def own_pool(engine):
    """A compiler on a pool of its own with one worker, up: which worker takes a job is known."""
    pool = CompilePool(max_workers=1)
    compiler = ConstraintCompiler(engine.engine.tokenizer, engine.engine.vocab_size, [2], timeout=30.0, pool=pool)
    compiler.compile(StructuredOutputs(**fresh_regex()), timeout=300)
    yield compiler, pool
    pool.close()


def test_a_constraint_no_worker_takes_within_the_timeout_is_refused_as_busy(own_pool):
    """The queue's clock (it runs only while a worker is up): a job that waited past the timeout is
    never compiled; a 429/503, retry later."""
    compiler, pool = own_pool
    time.sleep(1.2)  # the worker has been up for more than the wait below
    job = CompileJob("structured_outputs.regex", "regex", "a+", True, compiler.tokenizer, TIMEOUT_S,
                     lambda *_: None, submitted=time.monotonic() - 2 * TIMEOUT_S, future=Future())
    with pytest.raises(GrammarCompilerBusy, match=r"^structured_outputs.regex: compile queue full: waited 1.\d s"):
        pool.submit(job).result(60)


def test_a_worker_that_dies_fails_its_compile_alone_and_is_replaced(own_pool):
    """A worker killed mid-compile (the OOM killer, a crash in xgrammar): that constraint is refused
    naming the crash; the next one gets a new worker."""
    import os
    import signal

    compiler, pool = own_pool
    future = compiler.submit(StructuredOutputs(json=SLOW))
    time.sleep(0.3)
    (worker,) = pool._workers
    os.kill(worker.proc.pid, signal.SIGKILL)
    with pytest.raises(CompileFailed, match=r"^structured_outputs.json: the grammar compiler crashed on it \(killed "
                                            r"by signal 9\)"):
        future.result(60)
    assert compiler.compile(StructuredOutputs(**fresh_regex()), timeout=300).kind == "regex"
