"""`return_queue_info` against a real tritonserver: a streamed request behind a blocked head receives
its place and then its reserved step before its first token, and both are right; the other outputs
and the OpenAI server's extension field."""
import threading
import time

import pytest

from client.grpc_client import GrpcClient

from .conftest import requires_tritonserver, wait_until

pytestmark = requires_tritonserver

BLOCK = 16
# 32 blocks of 16 tokens. A (8 + 240 tokens: 16 blocks to completion) runs; H (8 + 250: 17 blocks)
# cannot start beside it: the blocked head; R (8 + 245: 16 blocks) fits beside A, but would still
# hold its blocks when A ends and H's 17 must fit: backfill holds it back, behind H. A runs long
# enough (240 steps) that R surely arrives while H waits, even on a loaded machine.
A_TOKENS, H_TOKENS, R_TOKENS = 240, 250, 245
PARAMS = {"max_model_len": "320", "cpu_kv_cache_tokens": str(32 * BLOCK), "kv_block_size": str(BLOCK),
          "max_num_seqs": "8"}
GREEDY = dict(temperature=0.0, ignore_eos=True, exclude_input_in_output=True)


@pytest.fixture(scope="module")
def small_server(model_repository, model_path):
    from serving.triton_launcher import TritonServer

    with TritonServer(model_repository, params=PARAMS, model_path=str(model_path)) as srv:
        yield srv


def stream_into(server, name, prompt, max_tokens, chunks, started=None, **options):
    def run():
        with GrpcClient(server.grpc_url, timeout=120) as client:
            for chunk in client.stream(prompt, max_tokens=max_tokens, **GREEDY, **options):
                chunks.append(chunk)
                if started is not None and chunk.token_ids:
                    started.set()
    thread = threading.Thread(target=run, name=name)
    thread.start()
    return thread


def test_a_streamed_request_behind_a_blocked_head_is_told_its_place_and_reserved_step_and_they_are_right(small_server):
    a, h, r = [], [], []
    a_running = threading.Event()
    threads = [stream_into(small_server, "A", list(range(3, 11)), A_TOKENS, a, started=a_running)]
    assert a_running.wait(60)
    threads.append(stream_into(small_server, "H", list(range(20, 28)), H_TOKENS, h, queue_info=True))
    wait_until(lambda: h, timeout=30)  # H is queued (its first report) before R arrives
    threads.append(stream_into(small_server, "R", list(range(40, 48)), R_TOKENS, r, queue_info=True))
    for t in threads:
        t.join(180)
    assert a[-1].finish_reason == h[-1].finish_reason == r[-1].finish_reason == "length"
    assert sum(len(c.token_ids) for c in r) == R_TOKENS

    first_token = next(i for i, c in enumerate(r) if c.token_ids)
    before = [c.queue for c in r[:first_token]]
    assert before and all(q is not None for q in before), "no queue report before the first token"
    h_started = h[-1].queue["first_scheduled_step"]
    # place 1 behind H while H waits, with no reservation (backfill reserves for the head only)
    behind = [q for q in before if q["queue_position"] == 1]
    assert behind and all(q["reserved_step"] == -1 and q["engine_step"] < h_started for q in behind)
    # once H runs, R is the head: told the step its start is reserved for
    head = [q for q in before if q["queue_position"] == 0]
    assert head and all(q["reserved_step"] >= q["engine_step"] >= h_started for q in head)
    reserved = min(q["reserved_step"] for q in head)
    start = r[first_token].queue
    assert start["queue_position"] == -1 and start["reserved_step"] == -1
    assert start["first_scheduled_step"] <= reserved, "R started after the step it was reserved for"
    assert start["first_scheduled_step"] == reserved  # ignore_eos: the worst case is what happens
    assert start["kv_blocks_reserved"] == -(-(8 + R_TOKENS - 1) // BLOCK) == 16
    # while it waited nothing had happened yet; at the end everything had, in order
    assert all(q["first_scheduled_time_ns"] == q["first_token_time_ns"] == q["finished_time_ns"] == 0 for q in before)
    end = r[-1].queue
    assert 0 < end["arrival_time_ns"] <= end["first_scheduled_time_ns"] <= end["first_token_time_ns"] \
        <= end["finished_time_ns"]
    assert abs(end["arrival_time_ns"] - time.time_ns()) < 300e9
    assert end["seconds_since_arrival"] >= (end["finished_time_ns"] - end["arrival_time_ns"]) / 1e9 - 1e-3
    assert all(c.queue is None for c in a)  # only who asked


def test_a_non_streaming_answer_carries_the_outputs_once(small_server):
    with GrpcClient(small_server.grpc_url) as client:
        chunks = list(client.stream("Hello", stream=False, max_tokens=4, queue_info=True, **GREEDY))
    assert len(chunks) == 1
    q = chunks[0].queue
    assert q["queue_position"] == -1 and q["first_scheduled_step"] >= 0 and q["kv_blocks_reserved"] >= 1
    assert q["arrival_time_ns"] <= q["first_scheduled_time_ns"] <= q["first_token_time_ns"] <= q["finished_time_ns"]


def test_the_openai_server_passes_it_through_when_asked(small_server, model_path):
    openai = pytest.importorskip("openai")
    from serving.openai_launcher import OpenAIServer

    with OpenAIServer(small_server.grpc_url, model_path) as api_server:
        api = openai.OpenAI(base_url=f"{api_server.url}/v1", api_key="unused", max_retries=0, timeout=120)
        plain = api.completions.create(model="llm", prompt="Hello", max_tokens=3, temperature=0)
        assert "queue_info" not in (plain.model_extra or {})  # off by default
        asked = api.completions.create(model="llm", prompt="Hello", max_tokens=3, temperature=0,
                                       extra_body={"return_queue_info": True})
        info = asked.choices[0].model_extra["queue_info"]
        assert info["queue_position"] == -1 and info["first_scheduled_step"] >= 0
        chunks = list(api.completions.create(model="llm", prompt="Hello", max_tokens=3, temperature=0, stream=True,
                                             extra_body={"return_queue_info": True}))
        infos = [c.choices[0].model_extra.get("queue_info") for c in chunks if c.choices]
        assert infos and all(i is not None for i in infos)
        assert infos[-1]["finished_time_ns"] >= infos[-1]["first_token_time_ns"] > 0
