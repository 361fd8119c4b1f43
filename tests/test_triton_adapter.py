"""The Triton adapter's logic without a server: config mapping, and the
Frontend's response rules (one response per step when streaming, one at the end otherwise, every
request closed with FINAL, cancellation, `stop` by request id, shutdown)."""
import threading
import time

import numpy as np
import pytest

from backend.core.outputs import Logprob, RequestOutput

from adapter_module import load_adapter

adapter = load_adapter()

VOCAB = 100


def S(*values):
    return np.array([v.encode() if isinstance(v, str) else v for v in values], dtype=np.object_)


def one(value, dtype):
    return np.array([value], dtype=dtype)


# -- engine_config ---------------------------------------------------------------------------------

def test_engine_config_device_follows_the_instance(tmp_path):
    """Triton's Python backend passes the kind as TRITONSERVER_InstanceGroupKindString writes it
    ("GPU", "CPU", "MODEL") and the device id as a string; "KIND_GPU" (config.pbtxt's spelling) is
    accepted too."""
    params = {"model_path": str(tmp_path), "max_num_seqs": "8"}
    assert adapter.engine_config(params, "GPU", "1", tmp_path).device == "cuda:1"
    assert adapter.engine_config(params, "KIND_GPU", 1, tmp_path).device == "cuda:1"
    assert adapter.engine_config({**params, "device": "cuda"}, "GPU", "1", tmp_path).device == "cuda:1"
    assert adapter.engine_config(params, "CPU", "0", tmp_path).device == "cpu"
    assert adapter.engine_config(params, "MODEL", "0", tmp_path).device == "cpu"
    forced = adapter.engine_config({**params, "device": "cpu"}, "GPU", "0", tmp_path)
    assert forced.device == "cpu" and forced.max_num_seqs == 8
    pinned = adapter.engine_config({**params, "device": "cuda:0"}, "GPU", "1", tmp_path)
    assert pinned.device == "cuda:0"


def test_engine_config_relative_model_path_is_from_the_repository_root(tmp_path):
    (tmp_path / "models" / "m").mkdir(parents=True)
    config = adapter.engine_config({"model_path": "models/m"}, "KIND_CPU", 0, tmp_path)
    assert config.model_path == str((tmp_path / "models" / "m").resolve())


@pytest.mark.parametrize("params,message", [
    ({"max_num_seqs": "many"}, "parameter 'max_num_seqs' must be an integer"),
    ({"no_such_key": "1"}, "unknown parameter 'no_such_key'"),
    ({"batch_scheduler_policy": "fifo"}, "batch_scheduler_policy must be one of guaranteed_no_evict, max_utilization"),
    ({"model_path": "/definitely/not/here"}, "parameter 'model_path': no checkpoint folder"),
])
def test_engine_config_refuses_bad_parameters(tmp_path, params, message):
    with pytest.raises(ValueError, match=message):
        adapter.engine_config({"model_path": str(tmp_path), **params}, "KIND_CPU", 0, tmp_path)


# -- Frontend ------------------------------------------------------------------------------------

class FakeTokenizer:
    def decode(self, ids):
        return "".join(chr(ord("a") + i % 26) for i in ids)


class FakeEngine:
    vocab_size = VOCAB
    max_model_len = 64
    tokenizer = FakeTokenizer()

    def __init__(self):
        self.requests = {}
        self.aborted = []
        self.lock = threading.Lock()

    def add_request(self, rid, prompt, params, on_output, priority=0, **kw):
        if prompt == "too long":
            raise ValueError("prompt has 999 tokens; max_model_len is 64")
        with self.lock:
            self.requests[rid] = (prompt, params, on_output, [])
            self.options = getattr(self, "options", {})
            self.options[rid] = kw

    def emit(self, rid, new_ids, finish_reason=None, error=None, index=0, new_logprobs=None, queue=None):
        """One step's output of completion `index`; new_logprobs: one float per new token; queue: a
        QueueInfo (the engine's answer to queue_info=True)."""
        prompt, params, cb, outs = self.requests[rid]
        while len(outs) <= index:
            outs.append(([], []))
        out, lps = outs[index]
        out.extend(new_ids)
        new_lp = None
        if new_logprobs is not None:
            new_lp = [{tid: Logprob(lp, 1, FakeTokenizer().decode([tid]))} for tid, lp in zip(new_ids, new_logprobs)]
            lps.extend(new_lp)
        cb(RequestOutput(rid, [1, 2], list(new_ids), list(out), FakeTokenizer().decode(new_ids),
                         FakeTokenizer().decode(out), finish_reason is not None, finish_reason, error,
                         index=index, new_logprobs=new_lp, logprobs=list(lps) if new_lp is not None else None,
                         cumulative_logprob=sum(next(iter(d.values())).logprob for d in lps)
                         if new_lp is not None else None, queue=queue))

    def abort(self, rid):
        with self.lock:
            self.aborted.append(rid)
            return rid in self.requests

    def stats(self):
        return {"num_requests_running": len(self.requests), "num_requests_waiting": 0,
                "kv_blocks_total": 10, "kv_blocks_used": 0, "kv_blocks_free": 10, "num_preemptions": 0,
                "prompt_tokens_total": 0, "generation_tokens_total": 0}

    def shutdown(self):
        for rid in list(self.requests):
            self.emit(rid, [], "abort")
            del self.requests[rid]


class FakeSender:
    def __init__(self):
        self.responses = []  # (tensors, error, final)
        self.cancelled = False
        self.cancel_checks = 0

    def is_cancelled(self):
        self.cancel_checks += 1
        return self.cancelled

    @property
    def final(self):
        return any(final for _, _, final in self.responses)


def respond(sender, tensors, error, final):
    assert not sender.final, "a response after the FINAL one"
    sender.responses.append((tensors, error, final))


class Metrics:
    def __init__(self):
        self.observed = []
        self.seconds = []
        self.updates = 0

    def observe(self, kind, seconds):
        self.observed.append(kind)
        self.seconds.append(seconds)

    def update(self, stats):
        self.updates += 1


def wait_for(predicate, timeout=3.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


@pytest.fixture
def frontend():
    engine, metrics = FakeEngine(), Metrics()
    fe = adapter.Frontend(engine, respond, metrics, poll_interval=0.01)
    yield fe
    fe.close(timeout=1)


ASK_ALL = {name: one(True, np.bool_) for name in ("return_finish_reason", "return_num_input_tokens",
                                                   "return_num_output_tokens")}


def submit(fe, client_id="", parameters=None, **inputs):
    sender = FakeSender()
    fe.submit(client_id, {"text_input": S("hi"), **inputs}, sender, parameters)
    rid = next((k for k, v in fe._live.items() if v.sender is sender), None)
    return rid, sender


def text(tensors):
    return tensors["text_output"][0].decode()


def test_streaming_sends_one_response_per_step_and_final_with_the_last(frontend):
    rid, sender = submit(frontend, stream=one(True, np.bool_), **ASK_ALL)
    engine = frontend.engine
    engine.emit(rid, [0])
    wait_for(lambda: len(sender.responses) == 1)  # the responder keeps up with the steps
    engine.emit(rid, [1])
    wait_for(lambda: len(sender.responses) == 2)
    engine.emit(rid, [2], "length")
    wait_for(lambda: sender.final)
    assert [final for _, _, final in sender.responses] == [False, False, True]
    assert [text(t) for t, _, _ in sender.responses] == ["a", "b", "c"]
    assert [list(t["output_ids"]) for t, _, _ in sender.responses] == [[0], [1], [2]]
    assert [list(t["finish_reason"]) for t, _, _ in sender.responses] == [[b"None"], [b"None"], [b"length"]]
    assert [list(t["num_output_tokens"]) for t, _, _ in sender.responses] == [[1], [1], [1]]
    assert all(list(t["num_input_tokens"]) == [2] for t, _, _ in sender.responses)
    wait_for(lambda: sorted(frontend.metrics.observed) == ["e2e", "itl", "itl", "ttft"])
    assert frontend.num_live() == 0


@pytest.mark.parametrize("backlog", [adapter.MAX_STREAM_BACKLOG, 2])
def test_streaming_sends_a_response_per_step_while_behind_and_merges_only_past_the_backlog(frontend, backlog):
    """The responder is held while 5 steps arrive: with the default backlog each step still gets
    its own response (as the vLLM backend sends them); past a backlog of 2 responses waiting, the
    later steps are merged into the newest of them, tokens and counts intact."""
    frontend.max_backlog = backlog
    release = threading.Event()

    class Blocking(list):  # the responder waits inside this request's respond until released
        def append(self, item):
            release.wait(10)
            super().append(item)

    blocker, blocked = submit(frontend, stream=one(True, np.bool_))
    blocked.responses = Blocking()
    rid, sender = submit(frontend, stream=one(True, np.bool_), **ASK_ALL)
    frontend.engine.emit(blocker, [9])
    wait_for(lambda: frontend.queue_depth() == 0)  # taken: the responder is now held
    for i in range(5):
        frontend.engine.emit(rid, [i], "length" if i == 4 else None)
    assert frontend.queue_depth() == min(5, backlog)
    release.set()
    wait_for(lambda: sender.final)
    want = [[0], [1], [2], [3], [4]] if backlog >= 5 else [[0], [1, 2, 3, 4]]
    assert [list(t["output_ids"]) for t, _, _ in sender.responses] == want
    assert frontend.num_coalesced == 5 - len(want)
    assert [text(t) for t, _, _ in sender.responses] == ["a", "b", "c", "d", "e"] if backlog >= 5 else ["a", "bcde"]
    assert [int(t["num_output_tokens"][0]) for t, _, _ in sender.responses] == [len(w) for w in want]
    assert [f for _, e, f in sender.responses if e is None] == [False] * (len(want) - 1) + [True]
    # the inter-token histogram counts tokens, however they were grouped
    wait_for(lambda: sorted(frontend.metrics.observed).count("itl") == 4)


def test_stream_interval_sends_the_first_token_at_once_then_every_n_tokens_and_the_end(frontend):
    frontend.stream_interval = 3
    rid, sender = submit(frontend, stream=one(True, np.bool_))
    quiet, _ = submit(frontend)  # not streaming: unaffected, one final answer
    for step in range(8):
        frontend.engine.emit(rid, [step], "length" if step == 7 else None)
        frontend.engine.emit(quiet, [step], "length" if step == 7 else None)
        time.sleep(0.01)  # the responder keeps up: nothing is merged but what the interval holds
    wait_for(lambda: sender.final)
    assert [list(t["output_ids"]) for t, _, _ in sender.responses] == [[0], [1, 2, 3], [4, 5, 6], [7]]
    assert [text(t) for t, _, _ in sender.responses] == ["a", "bcd", "efg", "h"]
    assert [f for _, _, f in sender.responses] == [False, False, False, True]
    wait_for(lambda: frontend.num_live() == 0)


def test_non_streaming_sends_exactly_one_final_response_with_the_prompt(frontend):
    rid, sender = submit(frontend)
    frontend.engine.emit(rid, [0])
    frontend.engine.emit(rid, [1], "stop")
    wait_for(lambda: sender.final)
    assert len(sender.responses) == 1
    tensors, error, final = sender.responses[0]
    assert final and error is None
    assert text(tensors) == "hiab" and list(tensors["output_ids"]) == [1, 2, 0, 1]

    rid, sender = submit(frontend, exclude_input_in_output=one(True, np.bool_))
    frontend.engine.emit(rid, [3], "length")
    wait_for(lambda: sender.final)
    assert text(sender.responses[0][0]) == "d" and list(sender.responses[0][0]["output_ids"]) == [3]


def test_non_streaming_outputs_wait_on_the_engine_side_until_the_end(frontend):
    rid, sender = submit(frontend)
    for step in range(6):
        frontend.engine.emit(rid, [step], "length" if step == 5 else None)
        time.sleep(0.01)  # the responder keeps up: only holding can keep steps 1-4 from it
    wait_for(lambda: sender.final)
    # the first token (TTFT) and the end reach the responder; the five later tokens are five ITL
    # samples of the mean gap, observed off the responder's thread
    wait_for(lambda: sorted(frontend.metrics.observed) == ["e2e"] + ["itl"] * 5 + ["ttft"])
    assert len(sender.responses) == 1 and list(sender.responses[0][0]["output_ids"])[-6:] == [0, 1, 2, 3, 4, 5]
    assert frontend.num_coalesced == 0


def test_refused_request_gets_an_error_with_final_at_once(frontend):
    _, sender = submit(frontend, max_tokens=one(0, np.int32))
    assert sender.responses == [(None, "max_tokens must be an integer >= 1; got 0", True)]
    _, sender = submit(frontend, text_input=S("too long"))
    assert sender.responses == [(None, "prompt has 999 tokens; max_model_len is 64", True)]
    assert frontend.num_live() == 0


def test_engine_error_ends_the_request_with_an_error(frontend):
    rid, sender = submit(frontend, stream=one(True, np.bool_))
    frontend.engine.emit(rid, [], "error", error="model step failed: boom")
    wait_for(lambda: sender.final)
    assert sender.responses == [(None, "model step failed: boom", True)]


def test_cancelled_request_is_aborted_and_closed(frontend):
    rid, sender = submit(frontend, stream=one(True, np.bool_))
    sender.cancelled = True
    wait_for(lambda: rid in frontend.engine.aborted)  # found by the poller, no output needed
    frontend.engine.emit(rid, [], "abort")
    wait_for(lambda: sender.final)
    assert sender.responses == [(None, None, True)]


def test_cancellation_is_checked_at_outputs_at_most_once_per_cancel_interval(frontend):
    frontend.poll_interval = 60  # the poller would not see it in time: the output check must
    rid, sender = submit(frontend, stream=one(True, np.bool_))
    frontend.engine.emit(rid, [5])  # checked here (never checked before): not cancelled
    wait_for(lambda: len(sender.responses) == 1)
    checks = sender.cancel_checks
    frontend.cancel_interval = 60
    frontend.engine.emit(rid, [6])  # checked 60 s ago at most: no IPC round trip now
    wait_for(lambda: len(sender.responses) == 2)
    assert sender.cancel_checks == checks
    frontend.cancel_interval = 0.0
    sender.cancelled = True
    frontend.engine.emit(rid, [7])
    wait_for(lambda: rid in frontend.engine.aborted)
    assert len(sender.responses) == 2  # nothing more is sent to a cancelled request


def test_stop_by_request_id(frontend):
    rid, first = submit(frontend, client_id="job-1", stream=one(True, np.bool_), **ASK_ALL)
    stopper = FakeSender()
    frontend.submit("job-1", {"stop": one(True, np.bool_)}, stopper)
    assert frontend.engine.aborted == [rid]
    tensors, error, final = stopper.responses[0]
    assert final and error is None and text(tensors) == "" and set(tensors) == {"text_output", "output_ids"}
    frontend.engine.emit(rid, [], "abort")
    wait_for(lambda: first.final)
    assert first.responses[-1][0]["finish_reason"][0] == b"abort"

    nobody = FakeSender()
    frontend.submit("job-2", {"stop": one(True, np.bool_)}, nobody)
    assert nobody.responses == [(None, "stop: no request with id 'job-2' is running", True)]
    anonymous = FakeSender()
    frontend.submit("", {"stop": one(True, np.bool_)}, anonymous)
    assert "needs the request id" in anonymous.responses[0][1]


def test_close_answers_every_open_request(frontend):
    senders = [submit(frontend, stream=one(True, np.bool_))[1] for _ in range(3)]
    frontend.close(timeout=1)
    assert all(s.final for s in senders)
    _, late = submit(frontend)
    assert late.responses == [(None, "the server is shutting down; retry later", True)]
    assert late.responses[0][1].code == "UNAVAILABLE"


def test_stop_file_aborts_everything(tmp_path):
    engine = FakeEngine()
    fe = adapter.Frontend(engine, respond, Metrics(), poll_interval=0.01, stop_file=tmp_path / "stop")
    try:
        rid, _ = submit(fe)
        time.sleep(0.05)
        assert engine.aborted == []
        (tmp_path / "stop").touch()
        wait_for(lambda: engine.aborted == [rid])
    finally:
        fe.close(timeout=1)
