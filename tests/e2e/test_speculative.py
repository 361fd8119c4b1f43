"""Speculative decoding through a real tritonserver: greedy outputs equal the engine's without
speculation for both proposers: n-gram on the tiny model (started the `make serve` way, `inflight serve
--speculative-config`, whose bad values are refused before Triton starts) and on SmolLM2 (which follows
its n-grams: drafts accepted and rejected), a draft model on the tiny model (the draft is the target:
every draft accepted); streamed responses carry the accepted tokens (num_output_tokens right, every
token counted once); the spec-decode metrics carry the instance labels; a stream cancelled while it
verifies drafts gives its blocks back. One server per (model, proposer), shared by the module's tests."""
from __future__ import annotations

import gc
import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from backend import LLM, SamplingParams
from client.grpc_client import GrpcClient

from .conftest import inflight_serve, requires_tritonserver, stop_serve, wait_until
from .series import gauge, samples

pytestmark = requires_tritonserver

PASSAGE = ("A server waits. Most of its life is spent waiting for a request to arrive, for a disk to answer, "
           "for a network packet to cross the room.")
ENGINE = {"max_model_len": "512", "cpu_kv_cache_tokens": "4096", "max_num_seqs": "16"}
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
# A draft model on SmolLM2 is left out: the draft proposer does not depend on the model, and the
# tiny model proves it token for token (every draft accepted) at a quarter of the cost.
CONFIGS = ["tiny, ngram", "tiny, draft", "smollm2, ngram"]
GREEDY = dict(temperature=0.0, exclude_input_in_output=True)


def prompts_for(path: str) -> list:
    from backend.text.tokenizer import Tokenizer
    tok = Tokenizer.from_dir(path)
    ask = f"Copy this text exactly:\n\n{PASSAGE}"
    chat = tok.render_chat([{"role": "user", "content": ask}]) if tok.chat_template else ask + "\n\n"
    return [chat, "The quick brown fox jumps over the lazy dog. The quick brown", PASSAGE + " " + PASSAGE[:60]]


_references: dict = {}


def reference(path: str, prompts: list, max_tokens: int) -> list:
    """The in-process engine on the same checkpoint, without speculation."""
    key = (path, max_tokens)
    if key not in _references:
        llm = LLM(path, max_model_len=512, cpu_kv_cache_tokens=4096)
        _references[key] = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0))
        del llm
        gc.collect()
    return _references[key]


class Served:
    """The addresses of a server `inflight serve` started (what the tests read of a TritonServer)."""

    def __init__(self, ports: dict):
        self.grpc_url = f"127.0.0.1:{ports['grpc']}"
        self.metrics_url = f"http://127.0.0.1:{ports['metrics']}/metrics"


def serve_with_speculation(model_repository, path: str, spec: dict):
    """`inflight serve --speculative-config SPEC` (the `make serve` path) on free ports: (process, Served)."""
    from serving.triton_launcher import free_port

    ports = {name: free_port() for name in ("http", "grpc", "metrics")}
    proc, _ = inflight_serve(["--model-repository", str(model_repository), "--model-path", path,
                              "--host", "127.0.0.1", "--http-port", str(ports["http"]),
                              "--grpc-port", str(ports["grpc"]), "--metrics-port", str(ports["metrics"]),
                              "--openai-port", "0", "--speculative-config", json.dumps(spec),
                              *(arg for key, value in ENGINE.items() for arg in ("--param", f"{key}={value}"))])
    return proc, Served(ports)


@pytest.fixture(scope="module", params=CONFIGS)
def spec_server(request, model_repository, model_path):
    from serving.triton_launcher import TritonServer
    from smollm2 import smollm2_dir

    model, proposer = request.param.split(", ")
    path = str(model_path) if model == "tiny" else str(smollm2_dir())
    spec = NGRAM if proposer == "ngram" else {"model": path, "num_speculative_tokens": 3}
    if request.param == "tiny, ngram":   # the command line's --speculative-config reaches the engine
        proc, served = serve_with_speculation(model_repository, path, spec)
        try:
            yield served, path, proposer, model
        finally:
            stop_serve(proc)
        return
    params = {**ENGINE, "speculative_config": json.dumps(spec)}
    with TritonServer(model_repository, params=params, model_path=path) as srv:
        yield srv, path, proposer, model


def test_greedy_outputs_equal_the_engine_without_speculation(spec_server):
    server, path, proposer, _ = spec_server
    prompts = prompts_for(path)
    ref = reference(path, prompts, 32)
    cases = [(prompt, expected, stream) for prompt, expected in zip(prompts, ref) for stream in (True, False)]

    def ask(case):
        with GrpcClient(server.grpc_url) as client:
            return client.generate(case[0], stream=case[2], max_tokens=32, **GREEDY)

    # All six at once: they speculate in one batch (a sixth of the steps one at a time would take)
    with ThreadPoolExecutor(len(cases)) as pool:
        results = list(pool.map(ask, cases))
    for (prompt, expected, stream), result in zip(cases, results):
        assert result.token_ids == expected.token_ids, (prompt, stream)
        assert result.text == expected.text
        assert result.finish_reason == expected.finish_reason


def test_streamed_responses_carry_the_accepted_tokens_and_the_metrics_count_them(spec_server):
    server, path, proposer, model = spec_server
    wait_until(lambda: gauge(server, "inflight_num_requests_running") == 0, timeout=30)
    time.sleep(0.5)  # histogram samples of earlier requests are written every 0.1 s
    itl_before = gauge(server, "inflight_inter_token_latency_seconds_count")
    drafts_before = gauge(server, "inflight_spec_decode_num_draft_tokens_total")
    prompt = prompts_for(path)[2]
    with GrpcClient(server.grpc_url) as client:
        chunks = list(client.stream(prompt, max_tokens=40, ignore_eos=True, **GREEDY))
    counts = [c.num_output_tokens for c in chunks]
    assert counts == [len(c.token_ids) for c in chunks] and sum(counts) == 40
    if proposer == "draft":  # the draft is the target: responses of several tokens
        assert max(counts) > 1
    wait_until(lambda: gauge(server, "inflight_inter_token_latency_seconds_count") == itl_before + 39, timeout=10)
    wait_until(lambda: gauge(server, "inflight_spec_decode_num_draft_tokens_total") > drafts_before, timeout=10)
    series = samples(server)
    for name in ("inflight_spec_decode_num_draft_tokens_total", "inflight_spec_decode_num_accepted_tokens_total",
                 "inflight_spec_decode_acceptance_length_count"):
        labels = next(s.labels for s in series if s.name == name)
        assert "instance" in labels and labels.get("device") == "cpu", (name, labels)
    assert gauge(server, "inflight_spec_decode_acceptance_length_count") > 0
    assert gauge(server, "inflight_spec_decode_num_failed_proposals_total") == 0   # exported, and nothing failed
    if proposer == "draft" or model == "smollm2":  # the random tiny model rarely follows an n-gram
        assert gauge(server, "inflight_spec_decode_num_accepted_tokens_total") > 0


def test_a_stream_cancelled_while_it_speculates_gives_its_blocks_back(spec_server):
    server, path, _, _ = spec_server
    with GrpcClient(server.grpc_url) as client:
        received = 0
        for chunk in client.stream(prompts_for(path)[2], max_tokens=300, ignore_eos=True, **GREEDY):
            received += len(chunk.token_ids)
            if received >= 8:
                assert gauge(server, "inflight_kv_blocks", state="used") > 0
                break  # leaving the loop cancels the request on the server
    wait_until(lambda: gauge(server, "inflight_kv_blocks", state="used") == 0, timeout=10)
    with GrpcClient(server.grpc_url) as client:
        assert client.generate("still serving", max_tokens=3).finish_reason == "length"


def test_inflight_serve_refuses_a_bad_speculative_config(model_path):
    """The command line: a bad value is refused before Triton starts (a good one serves: the
    "tiny, ngram" spec_server above is started by `inflight serve --speculative-config`)."""
    import subprocess
    import sys

    bad = subprocess.run([sys.executable, "-m", "client.cli", "serve", "--model-path", str(model_path),
                          "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 99}'],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "num_speculative_tokens must be an integer in [1, 32]; got 99" in bad.stderr
