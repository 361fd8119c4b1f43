"""The Frontend's responses against the vLLM backend's additional-outputs contract, without a
server: outputs only when asked, one entry per completion (n > 1), num_output_tokens per
response, logprobs as JSON per completion, cumulative_logprob, and the inter-token histogram
counting tokens however the responses were merged."""
import json
import math
import threading

import numpy as np
import pytest
from adapter_module import load_adapter
from templates import tensors as T
from test_triton_adapter import S, FakeEngine, FakeTokenizer, Metrics, one, respond, submit, wait_for

adapter = load_adapter()
FLAGS = ("return_finish_reason", "return_cumulative_logprob", "return_logprobs", "return_num_input_tokens",
         "return_num_output_tokens")
OUTPUT_OF = {"return_finish_reason": "finish_reason", "return_cumulative_logprob": "cumulative_logprob",
             "return_logprobs": "logprobs", "return_num_input_tokens": "num_input_tokens",
             "return_num_output_tokens": "num_output_tokens"}


@pytest.fixture
def frontend():
    fe = adapter.Frontend(FakeEngine(), respond, Metrics(), poll_interval=0.01)
    yield fe
    fe.close(timeout=1)


def flags(*names, value=True):
    return {name: one(value, np.bool_) for name in names}


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("asked", [(), FLAGS, FLAGS[:2], FLAGS[2:]], ids=["none", "all", "first2", "last3"])
def test_outputs_appear_exactly_when_asked_for(frontend, stream, asked):
    unasked = [f for f in FLAGS if f not in asked]
    rid, sender = submit(frontend, stream=one(stream, np.bool_), **flags(*asked), **flags(*unasked[:2], value=False),
                         sampling_parameters=S('{"logprobs": 0}'))
    frontend.engine.emit(rid, [0], new_logprobs=[-0.5])
    wait_for(lambda: frontend.queue_depth() == 0 and (sender.responses or not stream))
    frontend.engine.emit(rid, [1], "length", new_logprobs=[-0.25])
    wait_for(lambda: sender.final)
    for tensors, error, _ in sender.responses:
        assert error is None
        assert set(tensors) == {"text_output", "output_ids"} | {OUTPUT_OF[f] for f in asked}
        assert tensors["text_output"].shape == (1,)
    last = sender.responses[-1][0]
    if "return_num_input_tokens" in asked:
        assert last["num_input_tokens"].dtype == np.uint32 and list(last["num_input_tokens"]) == [2]
    if "return_num_output_tokens" in asked:
        assert last["num_output_tokens"].dtype == np.uint32
        assert list(last["num_output_tokens"]) == ([1] if stream else [2])  # per response
    if "return_cumulative_logprob" in asked:
        assert last["cumulative_logprob"].dtype == np.float32 and list(last["cumulative_logprob"]) == [-0.75]
    if "return_logprobs" in asked:
        got = [json.loads(t["logprobs"][0]) for t, _, _ in sender.responses]
        want = [[{"0": {"logprob": -0.5, "rank": 1, "decoded_token": "a"}}],
                [{"1": {"logprob": -0.25, "rank": 1, "decoded_token": "b"}}]]
        assert got == (want if stream else [want[0] + want[1]])


def test_without_the_sampling_key_logprobs_is_null_and_cumulative_nan(frontend):
    rid, sender = submit(frontend, **flags("return_logprobs", "return_cumulative_logprob"))
    frontend.engine.emit(rid, [0, 1], "length")
    wait_for(lambda: sender.final)
    tensors = sender.responses[0][0]
    assert list(tensors["logprobs"]) == [b"null"] and math.isnan(tensors["cumulative_logprob"][0])


@pytest.mark.parametrize("stream", [True, False])
def test_return_log_probs_gives_tensorrt_llms_cum_log_probs_and_output_log_probs(frontend, stream):
    """TensorRT-LLM's outputs: cum_log_probs [completions] (the running sum), output_log_probs
    [completions, tokens] (streaming: the new tokens'; else every generated token's, no prompt)."""
    rid, sender = submit(frontend, stream=one(stream, np.bool_), **flags("return_log_probs"))
    assert frontend.engine.requests[rid][1].logprobs == 0
    frontend.engine.emit(rid, [0], new_logprobs=[-0.5])
    wait_for(lambda: frontend.queue_depth() == 0 and (sender.responses or not stream))
    frontend.engine.emit(rid, [1, 1], "length", new_logprobs=[-0.25, -1.0])
    wait_for(lambda: sender.final)
    got = [(t["cum_log_probs"].tolist(), t["output_log_probs"].tolist()) for t, _, _ in sender.responses]
    assert all(t["cum_log_probs"].dtype == t["output_log_probs"].dtype == np.float32 for t, _, _ in sender.responses)
    assert got == ([([-0.5], [[-0.5]]), ([-1.75], [[-0.25, -1.0]])] if stream else [([-1.75], [[-0.5, -0.25, -1.0]])])


def test_n_completions_come_in_one_response_each_time(frontend):
    """As the vLLM backend: text_output, finish_reason, num_output_tokens, ... one entry per
    completion; a completion that ended keeps its finish_reason; no output_ids for n > 1."""
    rid, sender = submit(frontend, stream=one(True, np.bool_), sampling_parameters=S('{"n": 2}'),
                         **flags("return_finish_reason", "return_num_output_tokens"))
    engine = frontend.engine
    engine.emit(rid, [0], index=0)
    wait_for(lambda: len(sender.responses) == 1)
    engine.emit(rid, [1], index=1)
    wait_for(lambda: len(sender.responses) == 2)
    engine.emit(rid, [2], "stop", index=0)
    wait_for(lambda: len(sender.responses) == 3)
    engine.emit(rid, [3], "length", index=1)
    wait_for(lambda: sender.final)
    got = [([t.decode() for t in r["text_output"]], [f.decode() for f in r["finish_reason"]],
            list(r["num_output_tokens"])) for r, _, _ in sender.responses]
    assert got == [(["a", ""], ["None", "None"], [1, 0]), (["", "b"], ["None", "None"], [0, 1]),
                   (["c", ""], ["stop", "None"], [1, 0]), (["", "d"], ["stop", "length"], [0, 1])]
    assert all("output_ids" not in r for r, _, _ in sender.responses)
    assert [f for _, _, f in sender.responses] == [False, False, False, True]


def test_n_completions_without_streaming_answer_once_when_all_have_ended(frontend):
    rid, sender = submit(frontend, sampling_parameters=S('{"n": 3}'), **flags("return_num_output_tokens"))
    for step in range(3):
        for i in range(3):
            ends = step == i  # completion i ends at step i
            if step <= i:
                frontend.engine.emit(rid, [step + 10 * i], "stop" if ends else None, index=i)
    wait_for(lambda: sender.final)
    assert len(sender.responses) == 1
    tensors = sender.responses[0][0]
    want = ["hi" + FakeTokenizer().decode(ids) for ids in ([0], [10, 11], [20, 21, 22])]
    assert [t.decode() for t in tensors["text_output"]] == want
    assert list(tensors["num_output_tokens"]) == [1, 2, 3]


def test_inter_token_histogram_counts_every_token_of_merged_responses(frontend):
    """vLLM observes one ITL sample per token; merged outputs (a responder that fell behind) carry
    k tokens in one response: k samples of the mean gap, not one."""
    frontend.max_backlog = 1  # merge everything past one waiting response
    release = threading.Event()

    class Blocking(list):
        def append(self, item):
            release.wait(10)
            super().append(item)

    blocker, blocked = submit(frontend, stream=one(True, np.bool_))
    blocked.responses = Blocking()
    rid, sender = submit(frontend, stream=one(True, np.bool_))
    frontend.engine.emit(blocker, [9])
    wait_for(lambda: frontend.queue_depth() == 0)
    for i in range(8):
        frontend.engine.emit(rid, [i], "length" if i == 7 else None)
    release.set()
    wait_for(lambda: sender.final)
    assert len(sender.responses) == 1  # eight tokens, one response (the first waited for the blocker)
    metrics = frontend.metrics
    wait_for(lambda: metrics.observed.count("ttft") == 2 and metrics.observed.count("e2e") == 1)
    wait_for(lambda: metrics.observed.count("itl") == 7)
    gaps = [s for k, s in zip(metrics.observed, metrics.seconds) if k == "itl"]
    assert len(set(gaps)) == 1 and gaps[0] >= 0


def test_an_error_for_one_completion_ends_the_whole_request(frontend):
    rid, sender = submit(frontend, stream=one(True, np.bool_), sampling_parameters=S('{"n": 3}'))
    frontend.engine.emit(rid, [], "error", error="adding the request failed", index=0)
    wait_for(lambda: sender.final)
    assert sender.responses == [(None, "adding the request failed", True)] and frontend.num_live() == 0


QUEUE_OUTPUTS = set(T.QUEUE_INFO_OUTPUTS)


@pytest.mark.parametrize("stream", [True, False])
def test_queue_info_streams_while_waiting_and_rides_on_every_response(frontend, stream):
    """return_queue_info: the engine is asked for it; streaming, each change while the request
    waits is a response without tokens; every response carries the ten outputs, with the engine's
    monotonic times as Unix nanoseconds; not streaming, only the answer (with the last ones)."""
    import time

    from backend.core.outputs import QueueInfo

    rid, sender = submit(frontend, stream=one(stream, np.bool_), **flags("return_queue_info", "return_num_output_tokens"))
    engine = frontend.engine
    assert engine.options[rid] == {"queue_info": True}
    t0 = time.monotonic()

    def info(step, position, reserved=None, started=None, blocks=0, first_token=None, finished=None):
        return QueueInfo(step, position, reserved, started, blocks, t0, None if started is None else t0 + 0.5,
                         first_token, finished)

    engine.emit(rid, [], queue=info(3, 1))
    engine.emit(rid, [], queue=info(7, 0, reserved=12))
    engine.emit(rid, [0], queue=info(11, -1, started=11, blocks=5, first_token=t0 + 0.75))
    engine.emit(rid, [1], "length", queue=info(12, -1, started=11, blocks=5, first_token=t0 + 0.75, finished=t0 + 1))
    wait_for(lambda: sender.final)
    responses = [t for t, _, _ in sender.responses]
    assert all(QUEUE_OUTPUTS <= set(t) for t in responses)
    column = lambda name: [int(t[name][0]) for t in responses]  # noqa: E731
    if stream:
        assert column("queue_position") == [1, 0, -1, -1] and column("reserved_step") == [-1, 12, -1, -1]
        assert column("engine_step") == [3, 7, 11, 12] and column("first_scheduled_step") == [-1, -1, 11, 11]
        assert column("kv_blocks_reserved") == [0, 0, 5, 5] and column("num_output_tokens") == [0, 0, 1, 1]
        assert [list(t["output_ids"]) for t in responses] == [[], [], [0], [1]]
    else:
        assert len(responses) == 1 and column("queue_position") == [-1] and column("first_scheduled_step") == [11]
    last = responses[-1]
    unix = time.time_ns()
    arrival = int(last["arrival_time_ns"][0])
    assert abs(unix - arrival) < 60e9 and last["arrival_time_ns"].dtype == np.int64
    assert int(last["first_scheduled_time_ns"][0]) - arrival == pytest.approx(0.5e9, abs=1e3)
    assert int(last["first_token_time_ns"][0]) - arrival == pytest.approx(0.75e9, abs=1e3)
    assert int(last["finished_time_ns"][0]) - arrival == pytest.approx(1e9, abs=1e3)
    assert last["seconds_since_arrival"].dtype == np.float64 and 0 <= last["seconds_since_arrival"][0] < 60
    if stream:
        assert int(responses[0]["first_token_time_ns"][0]) == 0 and int(responses[0]["finished_time_ns"][0]) == 0


def test_queue_info_is_not_asked_of_the_engine_unless_requested(frontend):
    rid, sender = submit(frontend, stream=one(True, np.bool_))
    assert frontend.engine.options[rid] == {}
