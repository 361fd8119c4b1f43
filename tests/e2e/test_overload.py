"""Overload told early, against a real tritonserver and the OpenAI server with the official `openai`
SDK (docs/configuration.md, "Overload told early"): a full queue, and a time-to-first-token target
the queue cannot meet, are refused at arrival; Triton's error carries "retry after N s", the
OpenAI port answers 429 with `Retry-After: N`; a target the queue can meet is served; the
rejection counter moves by reason; a waiting request's queue info says how long it expects to wait."""
import json
import re
import threading
import time

import numpy as np
import pytest

from client.http_client import HttpClient
from serving.openai_launcher import OpenAIServer

from .conftest import grpc_error, requires_tritonserver, wait_until
from .series import gauge, samples

openai = pytest.importorskip("openai")
pytestmark = requires_tritonserver

# One request runs, two may wait; a long runner keeps them there (the tiny model: ~900 steps).
PARAMS = {"max_num_seqs": "1", "max_queue_size": "2", "max_model_len": "1024"}
RETRY = re.compile(r"retry after (\d+) s$")


@pytest.fixture(scope="module")
def served(model_repository, model_path):
    from serving.triton_launcher import TritonServer

    with TritonServer(model_repository, params=PARAMS, model_path=str(model_path)) as triton:
        with OpenAIServer(triton.grpc_url, model_path) as api:
            yield triton, api, openai.OpenAI(base_url=f"{api.url}/v1", api_key="unused", max_retries=0, timeout=60)


def rejected(triton) -> dict[str, float]:
    """inflight_num_requests_rejected_total by reason."""
    by_reason: dict[str, float] = {}
    for s in samples(triton):
        if s.name == "inflight_num_requests_rejected_total":
            by_reason[s.labels["reason"]] = by_reason.get(s.labels["reason"], 0.0) + s.value
    return by_reason


def run_in_background(triton, names, max_tokens):
    http = HttpClient(triton.http_url)
    threads = [threading.Thread(target=_quiet, args=(http.generate, "keep the engine busy"),
                                kwargs=dict(request_id=n, max_tokens=max_tokens, ignore_eos=True)) for n in names]
    for t in threads:
        t.start()
    return threads


def stop(triton, names, threads):
    http = HttpClient(triton.http_url)
    for n in names:
        _quiet(http.stop, n)
    for t in threads:
        t.join(60)


def _quiet(fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except Exception:
        return None


def text_tensors(prompt: str, max_tokens: int, sampling: dict = None):
    tensors = [("text_input", np.array([prompt.encode()], dtype=object), "BYTES"),
               ("max_tokens", np.array([max_tokens], dtype=np.int32), "INT32")]
    if sampling:
        tensors.append(("sampling_parameters", np.array([json.dumps(sampling).encode()], dtype=object), "BYTES"))
    return tensors


def test_a_full_queue_is_a_429_with_retry_after_and_the_figure_is_in_the_triton_error(served):
    triton, api, sdk = served
    names = ["runner", "wait-1", "wait-2"]
    threads = run_in_background(triton, names[:1], 900)
    wait_until(lambda: gauge(triton, "inflight_num_requests_running") == 1, timeout=30)
    threads += run_in_background(triton, names[1:], 50)
    try:
        wait_until(lambda: gauge(triton, "inflight_num_requests_waiting") == 2, timeout=30)
        before = rejected(triton)
        message = grpc_error(triton, text_tensors("one too many", 4))  # tritonclient
        assert "queue full: 2 requests are waiting (max_queue_size)" in message and RETRY.search(message), message
        started = time.monotonic()
        with pytest.raises(openai.RateLimitError) as refused:
            sdk.completions.create(model="llm", prompt="one too many", max_tokens=4)
        assert time.monotonic() - started < 5  # told at arrival, not after waiting
        seconds = refused.value.response.headers["retry-after"]
        assert seconds.isdigit() and int(seconds) >= 1
        assert refused.value.status_code == 429 and f"retry after {seconds} s" in refused.value.message
        # (the metrics follow the engine's figures within a refresh)
        wait_until(lambda: rejected(triton)["queue_full"] - before.get("queue_full", 0) == 2, timeout=10)
        assert rejected(triton).get("ttft_target", 0) == before.get("ttft_target", 0)
    finally:
        stop(triton, names, threads)


def test_a_ttft_target_the_queue_cannot_meet_is_refused_and_one_it_can_is_served(served):
    triton, api, sdk = served
    threads = run_in_background(triton, ["long"], 900)
    try:
        wait_until(lambda: gauge(triton, "inflight_num_requests_running") == 1, timeout=30)
        time.sleep(0.2)  # some of its steps measured: the engine knows its step time
        before = rejected(triton)
        # 1 ms: the runner has hundreds of steps left on the only slot (max_num_seqs 1)
        message = grpc_error(triton, text_tensors("in a hurry", 4, {"ttft_target_ms": 1}))
        assert "cannot meet the time-to-first-token target" in message and RETRY.search(message), message
        with pytest.raises(openai.RateLimitError) as refused:
            sdk.completions.create(model="llm", prompt="in a hurry", max_tokens=4, extra_body={"ttft_target_ms": 1})
        assert int(refused.value.response.headers["retry-after"]) >= 1
        wait_until(lambda: rejected(triton)["ttft_target"] - before.get("ttft_target", 0) == 2, timeout=10)
        assert rejected(triton).get("queue_full", 0) == before.get("queue_full", 0)
        # ten minutes: it can wait for the runner, and is served; while it waits, queue info says how long
        chunks = list(sdk.completions.create(model="llm", prompt="patient", max_tokens=4, stream=True, extra_body={
            "ttft_target_ms": 600_000, "ignore_eos": True, "return_queue_info": True}))
        assert chunks[-1].choices[0].finish_reason == "length"
        waits = [c.choices[0].queue_info["expected_wait_seconds"] for c in chunks
                 if c.choices and c.choices[0].queue_info["queue_position"] == 0]
        assert waits and waits[0] > 0, waits
    finally:
        stop(triton, ["long"], threads)
