"""Tensor parallelism served by the real tritonserver (issue 26), gloo on this CPU:
- `inflight serve --tp 2` (the tiny model) and `--tp 3` (SmolLM2, whose heads do not split in 2:
  `--tp 2` fails its load naming both head counts) answer token for token as the one-rank engine
  in-process, a LoRA adapter's requests (`--lora-modules`) too; a Ctrl-C with requests in flight ends each of them with `abort` and leaves no
  process behind (workers included);
- a worker killed with SIGKILL fails the running requests with an error naming the rank, Triton
  reports the model not ready (it unloads itself), the liveness check fails, the server stays up,
  and nothing is left once the server stops."""
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import psutil
import pytest

from client.grpc_client import GrpcClient
from client.protocol import GenerationError
from serving.triton_launcher import TritonServer, free_port
from tp_helpers import NATURAL_PROMPTS, greedy, random_prompts, tp_workers

from .conftest import MAX_MODEL_LEN, inflight_serve, requires_tritonserver, stop_serve, wait_until
from .raw_requests import array, grpc_stream

pytestmark = requires_tritonserver
HEALTHCHECK = Path(__file__).resolve().parents[2] / "deploy" / "docker" / "healthcheck.py"


def healthcheck(server) -> subprocess.CompletedProcess:
    """deploy/docker/healthcheck.py, as the Docker HEALTHCHECK and the Kubernetes liveness probe run it."""
    return subprocess.run([sys.executable, str(HEALTHCHECK), "--url", f"http://{server.http_url}", "--timeout", "30"],
                          capture_output=True, text=True, timeout=60)


def test_inflight_serve_tp2_is_token_exact_and_a_stop_in_flight_loses_no_response(model_repository, model_path, llm,
                                                                                   tmp_path):
    from backend import LLM, SamplingParams
    from lora_adapters import AdapterSpec, make_adapter

    adapter = make_adapter(model_path, tmp_path / "tp-lora", seed=31, spec=AdapterSpec(r=8, alpha=16))
    grpc = free_port()
    proc, lines = inflight_serve(["--model-repository", str(model_repository), "--model-path", str(model_path),
                                  "--host", "127.0.0.1", "--http-port", str(free_port()), "--grpc-port", str(grpc),
                                  "--metrics-port", str(free_port()), "--openai-port", "0", "--tp", "2",
                                  "--param", f"max_model_len={MAX_MODEL_LEN}", "--lora-modules", f"tp={adapter}"])
    try:
        children = psutil.Process(proc.pid).children(recursive=True)
        assert len(tp_workers(proc.pid)) == 1, [" ".join(c.cmdline()) for c in children]
        batch = random_prompts(16, seed=3)
        expected = llm.generate(batch, greedy(12))
        got: dict[int, list[int]] = {}

        def ask(i):
            with GrpcClient(f"127.0.0.1:{grpc}") as client:
                got[i] = client.generate(batch[i], max_tokens=12, temperature=0.0, ignore_eos=True,
                                         exclude_input_in_output=True).token_ids

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(batch))]  # batched in flight
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert [got.get(i) for i in range(len(batch))] == [o.token_ids for o in expected]

        # the adapter's requests (lora_name, the vLLM backend's key) as the one-rank engine with it answers
        one = LLM(str(model_path), max_model_len=MAX_MODEL_LEN, enable_lora=True, lora_modules=f"tp={adapter}")
        texts = [f"adapter prompt {i} {'x' * i}" for i in range(3)]
        params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
        for text, want_lora, want_base in zip(texts, one.generate(texts, params, lora_request="tp"),
                                             one.generate(texts, params)):
            inputs = {"text_input": array(text), "stream": array(False), "exclude_input_in_output": array(True)}
            answer = grpc_stream(f"127.0.0.1:{grpc}", inputs, parameters={
                "temperature": "0", "max_tokens": "10", "ignore_eos": "true", "lora_name": "tp"})
            assert answer[0]["text_output"][0].decode() == want_lora.text != want_base.text

        ends, started = {}, threading.Barrier(5)

        def stream(i):
            chunks = []
            try:
                with GrpcClient(f"127.0.0.1:{grpc}") as client:
                    for chunk in client.stream(f"stream {i} until the server stops", max_tokens=480, ignore_eos=True):
                        chunks.append(chunk)
                        if len(chunks) == 2:
                            started.wait(60)
            finally:
                ends[i] = chunks

        streams = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
        for t in streams:
            t.start()
        started.wait(60)
        os.kill(proc.pid, signal.SIGINT)   # Ctrl-C with four streams running
        for t in streams:
            t.join(60)
        assert sorted(ends) == [0, 1, 2, 3]
        assert all(chunks[-1].finish_reason == "abort" and len(chunks) < 480 for chunks in ends.values()), ends
        assert proc.wait(60) == 0
        gone, alive = psutil.wait_procs(children, timeout=10)
        assert not alive, f"left behind: {[' '.join(p.cmdline()) for p in alive]}"
    finally:
        stop_serve(proc)


def test_inflight_serve_tp3_on_smollm2_is_token_exact(model_repository):
    """SmolLM2 (float import) splits in 3 (9 heads, 3 KV heads): served at TP=3 it answers the
    natural prompts token for token as one rank in-process."""
    from backend import LLM
    from smollm2 import smollm2_dir

    one = LLM(str(smollm2_dir()), max_model_len=256, cpu_kv_cache_tokens=4096)
    batch = [one.tokenizer.encode(text) for text in NATURAL_PROMPTS]
    expected = [o.token_ids for o in one.generate(batch, greedy(8))]
    del one
    grpc = free_port()
    proc, _ = inflight_serve(["--model-repository", str(model_repository), "--model-path", str(smollm2_dir()),
                              "--host", "127.0.0.1", "--http-port", str(free_port()), "--grpc-port", str(grpc),
                              "--metrics-port", str(free_port()), "--openai-port", "0", "--tp", "3",
                              "--param", "max_model_len=256", "--param", "cpu_kv_cache_tokens=4096"], timeout=300)
    try:
        assert len(tp_workers(proc.pid)) == 2
        got: dict[int, list[int]] = {}

        def ask(i):
            with GrpcClient(f"127.0.0.1:{grpc}") as client:
                got[i] = client.generate(batch[i], max_tokens=8, temperature=0.0, ignore_eos=True,
                                         exclude_input_in_output=True).token_ids

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(batch))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert [got.get(i) for i in range(len(batch))] == expected
    finally:
        stop_serve(proc)


def test_a_killed_rank_fails_what_runs_and_the_model_reports_not_ready(model_repository, model_path):
    server = TritonServer(model_repository, model_path=str(model_path),
                          params={"max_model_len": str(MAX_MODEL_LEN), "tensor_parallel_size": "2"})
    with server:
        everything = psutil.Process(server.process.pid).children(recursive=True)
        (worker,) = tp_workers(server.process.pid)
        assert healthcheck(server).returncode == 0                     # live: a 1-token generate goes through
        errors, first = {}, threading.Barrier(3)

        def stream(i):
            try:
                with GrpcClient(server.grpc_url, timeout=60) as client:
                    for n, _ in enumerate(client.stream(f"running {i} when a rank dies", max_tokens=480,
                                                        ignore_eos=True)):
                        if n == 1:
                            first.wait(60)
            except GenerationError as exc:
                errors[i] = str(exc)

        streams = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
        for t in streams:
            t.start()
        first.wait(60)
        worker.send_signal(signal.SIGKILL)
        for t in streams:
            t.join(60)
        assert sorted(errors) == [0, 1], errors
        for message in errors.values():
            assert f"tensor-parallel rank 1 (pid {worker.pid}) was killed by signal 9 (SIGKILL)" in message, message
        wait_until(lambda: not server.is_ready(), timeout=30)         # /v2/models/llm/ready: not ready
        assert healthcheck(server).returncode == 1                     # the liveness check fails
        with GrpcClient(server.grpc_url, timeout=30) as client, pytest.raises(GenerationError):
            client.generate("after the rank died", max_tokens=2)
        assert server.process.poll() is None                           # tritonserver itself runs on
        assert "unloaded: it reports not ready" in server.log_text()
    gone, alive = psutil.wait_procs(everything, timeout=10)
    assert not alive, f"left behind: {[' '.join(p.cmdline()) for p in alive]}"


def test_inflight_serve_tp2_on_smollm2_fails_the_load_naming_both_head_counts(model_repository):
    """SmolLM2's 9 attention heads and 3 KV heads do not split in 2: the load fails with rank 0's
    own check (no worker started), which Triton's model table and `inflight serve` show."""
    from smollm2 import smollm2_dir

    proc = subprocess.run([sys.executable, "-m", "client.cli", "serve", "--model-repository", str(model_repository),
                           "--model-path", str(smollm2_dir()), "--tp", "2", "--host", "127.0.0.1", "--openai-port", "0",
                           "--http-port", str(free_port()), "--grpc-port", str(free_port()),
                           "--metrics-port", str(free_port())], capture_output=True, text=True, timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 1, output[-3000:]
    assert ("UNAVAILABLE: Internal: TritonModelException: inflight: tensor_parallel_size 2 does not divide the "
            "model's num_attention_heads 9" in output and "num_key_value_heads 3" in output), output[-3000:]
    assert "tensor-parallel rank 1" not in output and "inflight tp rank" not in output   # refused before any rank
