"""Issue 44's mixed load on one real tritonserver: chat with images (Gemma 3 vision, model `llm`) and
embeddings (a Qwen3 embedding checkpoint served by the pooling runner, model `embed`, a second model
repository) at once, as a Triton user serves both kinds (docs/vision.md "A mixed load"). Every
answer is checked against the in-process engine (greedy tokens, vectors), nothing is lost (requests
in = answers out), and afterwards the metrics show the KV cache, the queue and the encoder cache
back to idle (no block used, nothing running or waiting, the encoder cache within its budget)."""
from __future__ import annotations

import base64
import random
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from .conftest import MODEL_DIR, cpu_repository, requires_tritonserver, wait_until
from .raw_requests import grpc_stream, http_generate
from .series import gauge

pytestmark = requires_tritonserver

MAX_TOKENS = 5
BOI = 2000  # the tokenizer's <start_of_image> (tests/vision_checkpoint.py)
IMAGE_BYTES = 9 * 64 * 4  # an encoded image: 9 tokens x hidden 64, float32
ENCODER_BUDGET = 2 * IMAGE_BYTES + 100  # two images fit; the load sends four different ones


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, model_path):
    from pooling_models import qwen3_pooling_checkpoint, with_tokenizer
    from vision_checkpoint import make_vision_checkpoint

    vision = make_vision_checkpoint(tmp_path_factory.mktemp("mixed-vision"), seed=5, tokenizer=True)
    embed = with_tokenizer(qwen3_pooling_checkpoint(tmp_path_factory.mktemp("mixed-embed"), "model", seed=12,
                                                    vocab_size=2000), model_path)
    return vision, embed


@pytest.fixture(scope="module")
def mixed_server(checkpoints, tmp_path_factory):
    from serving.triton_launcher import TritonServer
    from templates.render import apply_overrides, render

    vision, embed = checkpoints
    repo = tmp_path_factory.mktemp("mixed-repo")
    cpu_repository(repo)
    second = tmp_path_factory.mktemp("mixed-embed-repo")  # tritonserver takes several --model-repository
    (second / "embed").mkdir()
    text = render(gpus=[]).replace('name: "llm"', 'name: "embed"', 1)
    (second / "embed" / "config.pbtxt").write_text(apply_overrides(text, {
        "model_path": str(embed), "max_model_len": "96", "max_num_batched_tokens": "32", "kv_block_size": "16"}))
    (second / "embed" / "1").symlink_to(MODEL_DIR, target_is_directory=True)
    params = {"max_model_len": "256", "limit_mm_per_prompt": "2", "max_num_batched_tokens": "48",
              "kv_block_size": "16", "encoder_cache_bytes": str(ENCODER_BUDGET)}
    with TritonServer(repo, params=params, model_path=str(vision),
                      extra_args=(f"--model-repository={second}",)) as srv:
        yield srv


def png(seed, width, height):
    from vision_checkpoint import image_bytes, random_image
    return image_bytes(random_image(seed, width, height), "PNG")


def chat(server, prompt, images):
    inputs = {"input_ids": np.array(prompt, dtype=np.int32),
              "image": np.array([base64.b64encode(b) for b in images], dtype=np.object_),
              "max_tokens": np.array([MAX_TOKENS], dtype=np.int32), "temperature": np.array([0.0], dtype=np.float32),
              "ignore_eos": np.array([True]), "exclude_input_in_output": np.array([True])}
    if not images:
        del inputs["image"]
    return grpc_stream(server.grpc_url, inputs)[-1]["output_ids"].tolist()


def embed(server, ids):
    out = http_generate(server.http_url, {"input_ids": ids}, stream=False, model="embed", timeout=120)
    return np.asarray(out[0]["embedding"], dtype=np.float32)


def test_chat_images_and_embeddings_at_once(mixed_server, checkpoints):
    from backend import LLM, SamplingParams

    vision, embedder = checkpoints
    rng = random.Random(44)
    images = [png(10 + i, rng.randrange(20, 70), rng.randrange(20, 70)) for i in range(4)]
    work = []
    for i in range(10):  # chat with one or two images, text-only chat, embeddings: lengths not block multiples
        which = [images[i % 4]] + ([images[(i + 1) % 4]] if i % 3 == 0 else [])
        ids = [rng.randrange(3, 1900) for _ in range(rng.randrange(3, 20))]
        work.append(("chat", ids[:2] + [BOI] * len(which) + ids[2:], which))
        work.append(("chat", [rng.randrange(3, 1900) for _ in range(rng.randrange(5, 40))], []))
        work.append(("embed", [rng.randrange(3, 1999) for _ in range(rng.randrange(5, 70))], None))
    rng.shuffle(work)

    def one(item):
        kind, ids, which = item
        return chat(mixed_server, ids, which) if kind == "chat" else embed(mixed_server, ids)

    with ThreadPoolExecutor(max_workers=12) as pool:
        answers = list(pool.map(one, work))
    assert len(answers) == len(work)  # nothing lost: every request answered (a failure raises)

    generator = LLM(str(vision), max_model_len=256)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    chats = [(ids, which) for kind, ids, which in work if kind == "chat"]
    want = generator.generate([{"prompt_token_ids": ids, "multi_modal_data": {"image": which}} if which else
                               {"prompt_token_ids": ids} for ids, which in chats], params)
    got = [a for (kind, _, _), a in zip(work, answers) if kind == "chat"]
    assert got == [o.token_ids for o in want]
    pooler = LLM(str(embedder), max_model_len=96)
    vectors = [o.pooled for o in pooler.embed([ids for kind, ids, _ in work if kind == "embed"])]
    for got, exp in zip([a for (kind, _, _), a in zip(work, answers) if kind == "embed"], vectors):
        assert got.shape == np.asarray(exp).shape and np.allclose(got, exp, atol=1e-5)

    idle = {"inflight_kv_blocks": {"state": "used"}, "inflight_num_requests_running": {},
            "inflight_num_requests_waiting": {}}
    wait_until(lambda: all(gauge(mixed_server, name, **labels) == 0 for name, labels in idle.items())
               and gauge(mixed_server, "inflight_pooling_requests_total") == 10, timeout=15)  # metrics lag a step
    assert 0 < gauge(mixed_server, "inflight_encoder_cache_bytes") <= ENCODER_BUDGET
    assert gauge(mixed_server, "inflight_encoder_runs_total") >= 4


def test_the_locust_scenario_runs_without_failures_and_leaves_the_server_idle(mixed_server, tmp_path):
    """client/tools/load/mixed_locustfile.py, headless and bounded, against the same two models."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    prefix = tmp_path / "locust"
    locust = Path(sys.executable).with_name("locust")
    # --json-file, not --csv: the CSV's last write comes before Locust has waited for the users'
    # last requests (--stop-timeout), so under load (two busy processes beside this file and the
    # gateway test) its table once held no request at all while the summary counted five
    cmd = [str(locust), "-f", str(root / "client" / "tools" / "load" / "mixed_locustfile.py"), "--headless",
           "-u", "5", "-r", "5", "-t", "4s", "--stop-timeout", "60", "--host", f"http://{mixed_server.http_url}",
           "--json-file", str(prefix), "--loglevel", "WARNING"]
    env = dict(os.environ, INFLIGHT_MAX_TOKENS="4", PYTHONPATH=str(root))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=150, cwd=root)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    stats = {e["name"]: e for e in json.loads(Path(f"{prefix}.json").read_text())}
    for name in ("chat+image", "chat", "embed"):
        assert name in stats, (name, stats.keys(), proc.stderr[-3000:])
        assert stats[name]["num_requests"] > 0 and stats[name]["num_failures"] == 0, stats[name]
    idle = {"inflight_kv_blocks": {"state": "used"}, "inflight_num_requests_running": {},
            "inflight_num_requests_waiting": {}}
    wait_until(lambda: all(gauge(mixed_server, name, **labels) == 0 for name, labels in idle.items()), timeout=15)
    assert gauge(mixed_server, "inflight_encoder_cache_bytes") <= ENCODER_BUDGET
