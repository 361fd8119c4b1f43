"""End to end against a real tritonserver (the nvidia-pytriton binary) on free loopback ports,
serving the default model: what a client sees over gRPC and HTTP, cancellation, bad requests,
metrics and a bad config."""
import asyncio
import re
import threading
import time
import urllib.request

import numpy as np
import pytest

from backend import SamplingParams
from client.grpc_client import AsyncGrpcClient, GrpcClient
from client.http_client import AsyncHttpClient, HttpClient
from client.protocol import GenerationError

from . import series
from .conftest import HAND_EDITED_KV_TOKENS, MAX_MODEL_LEN, grpc_error, requires_tritonserver, wait_until
from .series import gauge

pytestmark = requires_tritonserver

PROMPTS = ["Hello world", "The quick brown fox", "In-flight batching lets requests",
           "Once upon a time", "KV cache blocks", "a", "Tokens per second", "Triton"]
GREEDY = dict(temperature=0.0, exclude_input_in_output=True)


def reference(llm, prompt, max_tokens):
    return llm.greedy(prompt, max_tokens)


# -- correctness over gRPC and HTTP ----------------------------------------------------------------

def test_grpc_stream_matches_the_in_process_engine(server, llm):
    with GrpcClient(server.grpc_url) as client:
        for prompt in PROMPTS[:4]:
            ref = reference(llm, prompt, 24)
            result = client.generate(prompt, stream=True, max_tokens=24, **GREEDY)
            assert result.token_ids == ref.token_ids, prompt
            assert result.text == ref.text
            assert result.finish_reason == ref.finish_reason
            # streamed, at most one response per token: one per engine step while the responder keeps
            # up, merged only past MAX_STREAM_BACKLOG waiting ones (a busy machine can starve the
            # responder thread of this fast tiny model). Exactly one per step when it keeps up is
            # test_reliability.py's test_a_responder_that_keeps_up_sends_one_response_per_step.
            assert 1 < result.num_responses <= len(ref.token_ids) == result.num_output_tokens
            assert result.num_input_tokens == len(ref.prompt_token_ids)
        ids = ref.prompt_token_ids
        by_ids = client.generate(ids, stream=True, max_tokens=24, **GREEDY)
        assert by_ids.token_ids == ref.token_ids


def test_grpc_non_streaming_is_one_response_with_the_prompt(server, llm):
    ref = reference(llm, PROMPTS[1], 12)
    with GrpcClient(server.grpc_url) as client:
        result = client.generate(PROMPTS[1], stream=False, max_tokens=12, temperature=0.0)
    assert result.num_responses == 1
    assert result.text == PROMPTS[1] + ref.text
    assert result.token_ids == ref.prompt_token_ids + ref.token_ids
    assert result.num_output_tokens == len(ref.token_ids)


def test_http_generate_and_generate_stream_return_the_same_text(server, llm):
    ref = reference(llm, PROMPTS[0], 20)
    http = HttpClient(server.http_url)
    once = http.generate(PROMPTS[0], max_tokens=20, **GREEDY)
    assert once.num_responses == 1 and once.finish_reason == ref.finish_reason
    streamed = http.generate_stream(PROMPTS[0], max_tokens=20, **GREEDY)
    # as over gRPC (test_grpc_stream_matches_the_in_process_engine): at most one response per token,
    # merged only past MAX_STREAM_BACKLOG waiting ones when the responder falls behind (a clean-clone
    # run got 13 for 20 tokens); tests/e2e/test_reliability.py checks one per step when it keeps up
    assert 1 < streamed.num_responses <= len(ref.token_ids)
    assert once.text == streamed.text == ref.text
    assert once.token_ids == streamed.token_ids == ref.token_ids


def test_http_infer_refuses_the_decoupled_model(server):
    request = urllib.request.Request(f"http://{server.http_url}/v2/models/llm/infer", data=b'{"inputs": []}')
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=10)
    assert "decoupled" in info.value.read().decode()


def test_asyncio_clients(server, llm):
    ref = reference(llm, PROMPTS[2], 10)

    async def run():
        async with AsyncGrpcClient(server.grpc_url) as g, AsyncHttpClient(server.http_url) as h:
            return await asyncio.gather(g.generate(PROMPTS[2], stream=True, max_tokens=10, **GREEDY),
                                        h.generate(PROMPTS[2], max_tokens=10, **GREEDY),
                                        h.generate_stream(PROMPTS[2], max_tokens=10, **GREEDY))

    for result in asyncio.run(run()):
        assert result.token_ids == ref.token_ids and result.text == ref.text


def test_32_concurrent_streaming_clients_all_complete_correctly(server, llm):
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} number {i}" for i in range(32)]
    lengths = [8 + (i * 5) % 40 for i in range(32)]
    refs = llm.generate(prompts, [SamplingParams(max_tokens=n, temperature=0.0) for n in lengths])

    async def one(prompt, n):
        async with AsyncGrpcClient(server.grpc_url) as client:  # 32 separate clients
            return await client.generate(prompt, stream=True, max_tokens=n, **GREEDY)

    async def run():
        return await asyncio.gather(*(one(p, n) for p, n in zip(prompts, lengths)))

    started = time.monotonic()
    results = asyncio.run(run())
    elapsed = time.monotonic() - started
    for result, ref, n in zip(results, refs, lengths):
        assert result.token_ids == ref.token_ids and result.text == ref.text
        assert result.finish_reason == ref.finish_reason
    print(f"32 concurrent streams, {sum(len(r.token_ids) for r in results)} tokens in {elapsed:.2f}s")
    wait_until(lambda: gauge(server, "inflight_kv_blocks", state="used") == 0)


# -- cancellation ------------------------------------------------------------------------------------

def test_cancelling_a_stream_frees_its_kv_blocks(server):
    with GrpcClient(server.grpc_url) as client:
        received = 0
        for chunk in client.stream("Cancel me part-way", max_tokens=400, ignore_eos=True):
            received += len(chunk.token_ids)
            if received == 5:
                used = gauge(server, "inflight_kv_blocks", state="used")
                assert used > 0 and gauge(server, "inflight_num_requests_running") == 1
                break  # leaving the loop cancels the request on the server
    started = time.monotonic()
    wait_until(lambda: gauge(server, "inflight_kv_blocks", state="used") == 0, timeout=5)
    assert gauge(server, "inflight_num_requests_running") == 0
    assert time.monotonic() - started < 5
    with GrpcClient(server.grpc_url) as client:
        assert client.generate("still serving", max_tokens=3, ignore_eos=True).finish_reason == "length"


def test_stop_by_request_id_over_http(server):
    http = HttpClient(server.http_url)
    started = threading.Event()
    chunks = []

    def long_request():  # generate_stream, so that we know when it is running
        for chunk in http.stream("Stop me", request_id="stop-me-1", max_tokens=400, ignore_eos=True):
            chunks.append(chunk)
            started.set()

    worker = threading.Thread(target=long_request)
    worker.start()
    assert started.wait(30)
    stopped = http.stop("stop-me-1")
    worker.join(30)
    assert stopped.finish_reason == "abort"
    assert chunks[-1].finish_reason == "abort" and len(chunks) < 400
    wait_until(lambda: gauge(server, "inflight_kv_blocks", state="used") == 0, timeout=5)
    with pytest.raises(GenerationError, match="no request with id 'stop-me-1' is running"):
        http.stop("stop-me-1")


def test_stop_ends_a_non_streaming_http_generate(server):
    http = HttpClient(server.http_url)
    outcome = {}
    worker = threading.Thread(target=lambda: outcome.setdefault("result", http.generate(
        "Stop me too", request_id="stop-me-2", max_tokens=400, ignore_eos=True)))
    worker.start()
    deadline = time.monotonic() + 30
    while True:  # until the request has reached the engine
        try:
            http.stop("stop-me-2")
            break
        except GenerationError as exc:
            assert "no request with id" in str(exc) and time.monotonic() < deadline, exc
            time.sleep(0.02)
    worker.join(30)
    assert outcome["result"].finish_reason == "abort"
    assert outcome["result"].num_output_tokens < 400


# -- bad requests ------------------------------------------------------------------------------------

BAD_OPTIONS = [
    ("", dict(), "text_input is empty"),
    ([], dict(), "the prompt is empty"),
    ([1, 2, 99999], dict(), r"token id 99999 is outside the vocabulary \[0, 2000\)"),
    ([1, -3], dict(), r"token id -3 is outside the vocabulary"),
    ("word " * (MAX_MODEL_LEN + 10), dict(), f"max_model_len is {MAX_MODEL_LEN}"),
    ("hi", dict(max_tokens=0), "max_tokens must be an integer >= 1"),
    ("hi", dict(max_tokens=MAX_MODEL_LEN + 1), f"exceeds max_model_len \\({MAX_MODEL_LEN}\\)"),
    ("hi", dict(temperature=-0.5), "temperature must be a finite number >= 0"),
    ("hi", dict(temperature=float("nan")), "temperature must be a finite number.*got nan"),
    ("hi", dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
    ("hi", dict(top_p=1.01), r"top_p must be in \(0, 1\]"),
    ("hi", dict(top_k=-2), "top_k must be an integer >= -1"),
    ("hi", dict(seed=2**63), r"seed must be .*got 9223372036854775808"),
    ("hi", dict(min_tokens=9, max_tokens=4), "min_tokens must be in"),
]


@pytest.mark.parametrize("prompt,options,message", BAD_OPTIONS, ids=[m for _, _, m in BAD_OPTIONS])
def test_bad_request_gets_a_clear_error_over_grpc(server, prompt, options, message):
    with GrpcClient(server.grpc_url) as client:
        with pytest.raises(GenerationError, match=message):
            client.generate(prompt, stream=True, **options)


TEXT = ("text_input", np.array([b"hi"], dtype=np.object_), "BYTES")
RAW_BAD = [
    ([("max_tokens", np.array([4], np.int32), "INT32")], "no prompt"),
    ([TEXT, ("input_ids", np.array([1], np.int32), "INT32")], "either text_input or input_ids"),
    ([TEXT, ("max_tokens", np.array([4.0], np.float32), "FP32")], "max_tokens.*INT32|INT32.*max_tokens"),
    ([TEXT, ("temperature", np.array([0.5], np.float64), "FP64")], "temperature.*FP32|FP32.*temperature"),
    ([("text_input", np.array([1], np.int32), "INT32")], "text_input.*(STRING|BYTES)|(STRING|BYTES).*text_input"),
    ([TEXT, ("max_tokens", np.array([4, 5], np.int32), "INT32")], "max_tokens.*shape|shape.*max_tokens"),
    ([("input_ids", np.array([[1, 2]], np.int32), "INT32")], "input_ids.*shape|shape.*input_ids"),
]


@pytest.mark.parametrize("tensors,message", RAW_BAD, ids=[m.split(".")[0] for _, m in RAW_BAD])
def test_wrong_tensors_get_a_clear_error(server, tensors, message):
    error = grpc_error(server, tensors)
    assert re.search(message, error), error


def test_bad_requests_over_http_and_the_server_stays_ready(server):
    http = HttpClient(server.http_url)
    with pytest.raises(GenerationError, match="no prompt"):
        http.generate(None, max_tokens=3)
    with pytest.raises(GenerationError, match=r"top_p must be in \(0, 1\]"):
        http.generate_stream("hi", top_p=2.0)
    with pytest.raises(GenerationError, match="max_tokens must be an integer >= 1"):
        http.generate("hi", max_tokens=-4)
    assert server.is_ready() and http.is_ready()
    assert http.generate("fine", max_tokens=4, ignore_eos=True).finish_reason == "length"


def test_a_bad_request_does_not_disturb_running_ones(server, llm):
    ref = reference(llm, PROMPTS[3], 40)

    async def run():
        async with AsyncGrpcClient(server.grpc_url) as client:
            good = asyncio.ensure_future(client.generate(PROMPTS[3], stream=True, max_tokens=40, **GREEDY))
            await asyncio.sleep(0.05)
            bad = await asyncio.gather(*(client.generate("hi", top_k=-2) for _ in range(5)),
                                       return_exceptions=True)
            return await good, bad

    good, bad = asyncio.run(run())
    assert all(isinstance(b, GenerationError) for b in bad)
    assert good.token_ids == ref.token_ids


# -- metrics ------------------------------------------------------------------------------------------

GAUGES = ["inflight_num_requests_running", "inflight_num_requests_waiting", "inflight_kv_cache_usage_ratio"]
COUNTERS = ["inflight_num_preemptions_total", "inflight_prompt_tokens_total", "inflight_generation_tokens_total",
            "inflight_num_backfilled_total"]
HISTOGRAMS = ["inflight_time_to_first_token_seconds", "inflight_inter_token_latency_seconds",
              "inflight_e2e_request_latency_seconds", "inflight_request_queue_time_seconds"]


def _observed_all(server) -> bool:
    try:
        return all(gauge(server, f"{name}_count") >= 1 for name in HISTOGRAMS)
    except KeyError:
        return False


def test_metrics_endpoint_shows_the_design_names(server):
    with GrpcClient(server.grpc_url) as client:
        client.generate("count me", stream=True, max_tokens=6)
    wait_until(lambda: gauge(server, "inflight_generation_tokens_total") >= 6)
    wait_until(lambda: _observed_all(server))  # histograms are observed off the responder's thread
    names = series.names(server)
    for name in GAUGES + COUNTERS:
        assert name in names, name
    for name in HISTOGRAMS:
        assert {f"{name}_bucket", f"{name}_sum", f"{name}_count"} <= names, name
        assert gauge(server, f"{name}_count") >= 1
    for state in ("used", "free", "total", "reserved"):
        gauge(server, "inflight_kv_blocks", state=state)
    total = gauge(server, "inflight_kv_blocks", state="total")
    assert total == HAND_EDITED_KV_TOKENS // 16  # the hand-edited config.pbtxt value took effect
    assert gauge(server, "inflight_kv_blocks", state="free") + \
        gauge(server, "inflight_kv_blocks", state="used") == total
    assert gauge(server, "inflight_num_preemptions_total") == 0  # guaranteed_no_evict
    assert gauge(server, "inflight_prompt_tokens_total") > 0


@pytest.mark.parametrize("stream", [True, False])
def test_the_inter_token_histogram_counts_every_token(server, stream):
    """As vLLM: one sample per token after the first, whether the responses carried one token each
    (streaming) or all of them at once (one answer)."""
    def counts():
        return (gauge(server, "inflight_inter_token_latency_seconds_count"),
                gauge(server, "inflight_e2e_request_latency_seconds_count"))
    # Quiet first: requests of earlier tests (cancelled ones) may still be ending.
    wait_until(lambda: gauge(server, "inflight_num_requests_running") == 0
               and gauge(server, "inflight_num_requests_waiting") == 0, timeout=30)
    time.sleep(0.5)  # their samples are written off the responder's thread, every 0.1 s
    itl, e2e = counts()
    with GrpcClient(server.grpc_url) as client:
        client.generate("count my tokens", stream=stream, max_tokens=9, ignore_eos=True)
    wait_until(lambda: counts()[1] == e2e + 1)
    assert counts()[0] == itl + 8


# -- configuration -------------------------------------------------------------------------------------

@pytest.mark.parametrize("params,message", [
    ({"max_num_seqs": "lots"}, "parameter 'max_num_seqs' must be an integer; got 'lots'"),
    ({"no_such_key": "1"}, "unknown parameter 'no_such_key'; allowed parameters: "),
])
def test_a_bad_config_parameter_fails_the_load_naming_the_key(model_repository, model_path, params, message):
    from serving.process_group import group_alive
    from serving.triton_launcher import ServerError, TritonServer

    server = TritonServer(model_repository, params=params, model_path=str(model_path))
    try:
        server.start()
        pid = server.process.pid
        with pytest.raises(ServerError, match=re.escape(message)):
            server.wait_ready(120)
    finally:
        server.stop()
    assert not group_alive(pid), "a tritonserver or stub process was left behind"


def test_a_stub_asked_for_its_stacks_writes_them_to_the_log_and_serves_on(server):
    """What a load that never finishes would show (TritonServer.wait_ready asks on its timeout): each
    stub dumps every thread's Python stack to Triton's log on SIGUSR1 and carries on serving."""
    before = len(server.log_text())
    assert server.dump_stub_stacks(settle=1.0) >= 2  # llm and llm_trtllm
    dumped = server.log_text()[before:]
    assert "Thread 0x" in dumped and "File " in dumped, dumped[-2000:]
    assert "adapter.py" in dumped or "engine" in dumped, dumped[-2000:]  # (async_engine.py among them)
    with GrpcClient(server.grpc_url) as client:
        assert client.generate("still here", stream=False, max_tokens=3)
    import urllib.request
    for model in ("llm", "llm_trtllm"):  # both stubs lived through it
        with urllib.request.urlopen(f"http://{server.http_url}/v2/models/{model}/ready", timeout=5) as r:
            assert r.status == 200, model


def test_the_thread_states_name_tritonserver_and_its_stubs_threads(server):
    """The C++ half of the same diagnosis (TritonServer.wait_ready appends it on its timeout): a line
    per thread of tritonserver and of each stub, with the kernel function it waits in."""
    lines = server.thread_states().splitlines()[2:]
    pids = {line.split("/")[0] for line in lines}
    assert str(server.process.pid) in pids and len(pids) >= 3, lines[:20]  # tritonserver, llm's and llm_trtllm's stubs
    assert any("triton_python" in line or "python_backend" in line for line in lines), lines[:20]
    assert all(len(line.split(" ")) >= 4 for line in lines), lines[:20]
    # an idle stub's main thread waits on a futex in its shared-memory queue, reached from the stub's code
    # (a timed futex wait that a stop signal interrupted resumes as restart_syscall, its arguments kept: seen
    # in a run where a script stopped and continued the test processes now and then, to imitate a loaded
    # machine's pauses)
    waits = [line for line in lines if "arg0=triton_python_backend_shm_region_" in line]
    assert waits and all("syscall=futex" in line or "syscall=restart_syscall" in line for line in waits), lines[:20]
    assert any("triton_python_backend_stub+0x" in line.partition(" stack: ")[2] for line in waits), waits
    assert any("libtriton_python.so+0x" in line for line in lines), lines[:20]  # the backend's threads in tritonserver
    # and named (binutils' addr2line, which comes with the gcc the kernels are built with)
    assert any("triton::backend::python::" in line.partition(" stack: ")[2] for line in lines), lines[:20]
