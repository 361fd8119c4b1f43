"""`inflight bench --protocol openai` with the images and embeddings workloads against a real
tritonserver and the OpenAI server (docs/benchmarks.md): chat with images through
/v1/chat/completions (image_url data URLs, streamed) on the tiny Gemma 3 vision checkpoint, and
embeddings through /v1/embeddings on a pooling model; every request answered, the server's own
counters showing the work done (each image encoded, each embedding pooled) and the KV cache idle
afterwards."""
from __future__ import annotations

import json
import urllib.request

import pytest

from serving.openai_launcher import OpenAIServer

from .conftest import cpu_repository, requires_tritonserver, wait_until

pytestmark = [requires_tritonserver, pytest.mark.slow]


def metric(server, name: str, label: str = "") -> float:
    text = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith(name + "{") and label in line)


def served(repo, model_path, params):
    from serving.triton_launcher import TritonServer
    cpu_repository(repo)
    return TritonServer(repo, params=params, model_path=str(model_path))


def run_bench(api, triton, workload: str, tmp_path, n: int) -> dict:
    from client.tools.benchmarks import bench
    out = tmp_path / f"{workload}.json"
    rc = bench.main(["--protocol", "openai", "--url", api.url, "--metrics-url", triton.metrics_url,
                     "--workload", workload, "--num-requests", str(n), "--concurrency", "2", "--max-output-len", "4",
                     "--warmup", "0", "--seed", "3", "--no-progress", "--output-json", str(out)])
    data = json.loads(out.read_text())
    assert rc == 0, data["results"]
    return data


def test_the_images_workload_through_the_openai_port(tmp_path):
    from client.tools.benchmarks.workloads import make_workload
    from vision_checkpoint import make_vision_checkpoint
    vision = make_vision_checkpoint(tmp_path / "vision", seed=3, tokenizer=True)
    params = {"max_model_len": "512", "limit_mm_per_prompt": "2", "cpu_kv_cache_tokens": "4096"}
    with served(tmp_path / "repo", vision, params) as triton, OpenAIServer(triton.grpc_url, vision) as api:
        data = run_bench(api, triton, "images", tmp_path, 4)
        images = sum(len(w.images) for w in make_workload("images", 4, seed=3, prompt_format="text"))
        assert wait_until(lambda: metric(triton, "inflight_encoder_runs_total") == images, timeout=10)
        assert wait_until(lambda: metric(triton, "inflight_kv_blocks", 'state="used"') == 0, timeout=10)
    (r,) = data["results"]
    assert r["target"] == "server-openai" and r["completed"] == 4 and r["failed"] == 0
    assert r["output_tokens"] == 4 * 4 and r["ttft_p50_s"] is not None
    assert data["meta"]["workload_summary"]["images"] == images


def test_the_embeddings_workload_through_the_openai_port(tmp_path, model_path):
    from pooling_models import qwen3_pooling_checkpoint, with_tokenizer
    embed = with_tokenizer(qwen3_pooling_checkpoint(tmp_path / "embed", "model", seed=12, vocab_size=2000), model_path)
    params = {"max_model_len": "512", "max_num_batched_tokens": "64", "kv_block_size": "16"}
    with served(tmp_path / "repo", embed, params) as triton, OpenAIServer(triton.grpc_url, embed) as api:
        data = run_bench(api, triton, "embeddings", tmp_path, 6)
        assert wait_until(lambda: metric(triton, "inflight_pooling_requests_total") == 6, timeout=10)
        assert wait_until(lambda: metric(triton, "inflight_kv_blocks", 'state="used"') == 0, timeout=10)
    (r,) = data["results"]
    assert r["completed"] == 6 and r["failed"] == 0 and r["output_tokens"] == 0 and r["e2e_p50_s"] > 0
