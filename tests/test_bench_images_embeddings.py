"""`inflight bench`'s images and embeddings workloads (client/tools/benchmarks/workloads.py,
mm_requests.py): seeded and reproducible, their images real PNG files of the listed sizes, saved
and replayed through JSONL; a short in-process run of each (chat with images on the tiny Gemma 3
vision checkpoint: every image encoded, every answer its length, nothing held afterwards;
embeddings through the pooling runner); the server doors other than the OpenAI port refused."""
import io
import json

import numpy as np
import pytest

from client.tools.benchmarks import bench
from client.tools.benchmarks.mm_requests import EngineRequests
from client.tools.benchmarks.workloads import EMBEDDINGS, FIRST_ID, IMAGES, make_workload, write_jsonl
from vision_checkpoint import BOI, EOI, IMAGE_TOKEN, make_vision_checkpoint


def test_the_images_workload_is_seeded_pngs_of_the_listed_sizes(tmp_path):
    from PIL import Image
    items = make_workload("images", 12, seed=3, vocab_size=512)
    again = make_workload("images", 12, seed=3, vocab_size=512)
    assert [(w.prompt, w.images, w.max_tokens) for w in items] == [(w.prompt, w.images, w.max_tokens) for w in again]
    assert [w.images for w in make_workload("images", 12, seed=4, vocab_size=512)] != [w.images for w in items]
    counts = [len(w.images) for w in items]
    assert set(counts) == {1, 2}
    sizes = [Image.open(io.BytesIO(png)).size for w in items for png in w.images]
    assert all(png.startswith(b"\x89PNG") for w in items for png in w.images)
    assert set(sizes) <= set(IMAGES["sizes"]) and len(set(sizes)) >= 3
    assert len({png for w in items for png in w.images}) == sum(counts)   # every image its own
    assert all(16 <= w.prompt_len == len(w.prompt) <= 64 and 16 <= w.max_tokens <= 96 and w.kind == "generate"
               for w in items)
    path = tmp_path / "images.jsonl"
    write_jsonl(items, path)
    back = make_workload(str(path), 12)
    assert [(w.prompt, w.images, w.kind) for w in back] == [(w.prompt, w.images, w.kind) for w in items]


def test_the_embeddings_workload_is_pooling_requests_of_lognormal_lengths(tmp_path):
    items = make_workload("embeddings", 2000, seed=1)
    p = np.array([w.prompt_len for w in items])
    assert all(w.kind == "embed" and not w.images and len(w.prompt) == w.prompt_len for w in items)
    assert p.min() >= EMBEDDINGS["prompt_min"] and p.max() <= EMBEDDINGS["prompt_max"]
    assert abs(np.median(np.log(p)) - EMBEDDINGS["prompt_mean"]) < 0.08
    assert min(min(w.prompt) for w in items) >= FIRST_ID
    path = tmp_path / "e.jsonl"
    write_jsonl(items[:3], path)
    assert [w.kind for w in make_workload(str(path), 3)] == ["embed"] * 3


@pytest.fixture(scope="module")
def vision_dir(tmp_path_factory):
    return make_vision_checkpoint(tmp_path_factory.mktemp("bench-vision"), seed=2)


def test_engine_prompts_mark_each_image_and_never_a_stray_marker(vision_dir):
    items = make_workload("images", 4, seed=0, vocab_size=512)
    items[0].prompt[:3] = [BOI, EOI, IMAGE_TOKEN]   # random ids that happen to be the image markers
    requests = EngineRequests(str(vision_dir), None)
    for w in items:
        prompt = requests.prompt(w)
        ids = prompt["prompt_token_ids"]
        assert ids[:len(w.images)] == [BOI] * len(w.images) and ids.count(BOI) == len(w.images)
        assert EOI not in ids and IMAGE_TOKEN not in ids and prompt["multi_modal_data"]["image"] == list(w.images)
    assert requests.prompt(items[0])["prompt_token_ids"][len(items[0].images):][:3] == [FIRST_ID] * 3


@pytest.mark.slow  # the engine, 5 requests with 7 images: ~10 s
def test_an_in_process_run_with_images_encodes_every_image(vision_dir):
    from client.tools.benchmarks.targets import InProcessTarget
    items = make_workload("images", 5, seed=5, vocab_size=512, max_output_len=4)
    target = InProcessTarget(str(vision_dir), "inflight", {"max_num_batched_tokens": "64", "kv_block_size": "16"})
    try:
        result = target.run(items, 3)
        stats = target.engine.stats()
    finally:
        target.close()
    assert result["completed"] == 5 and result["failed"] == 0, result["errors"]
    assert result["output_tokens"] == sum(w.max_tokens for w in items) and result["ttft_p50_s"] is not None
    assert stats["encoder_runs_total"] == sum(len(w.images) for w in items)
    assert stats["kv_blocks_used"] == 0 and stats["num_requests_running"] == 0


@pytest.mark.slow
def test_bench_in_process_embeddings_through_the_pooling_runner(default_model_dir, tmp_path):
    out = tmp_path / "e.json"
    rc = bench.main(["--in-process", "--model-path", str(default_model_dir), "--workload", "embeddings",
                     "--num-requests", "6", "--concurrency", "3", "--warmup", "1", "--no-progress",
                     "--param", "runner=pooling", "--output-json", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    (r,) = data["results"]
    assert r["completed"] == 6 and r["failed"] == 0 and r["output_tokens"] == 0 and r["e2e_p50_s"] > 0
    assert data["meta"]["workload_summary"]["embeddings"] == 6


def test_the_new_workloads_go_in_process_or_through_the_openai_port(capsys):
    for argv in (["--url", "localhost:1", "--workload", "images"],
                 ["--url", "localhost:1", "--protocol", "http", "--workload", "embeddings"],
                 ["--offline", "--model-path", ".", "--workload", "images"]):
        assert bench.main(argv) == 2
        assert "runs --in-process or through an OpenAI port" in capsys.readouterr().err


@pytest.mark.slow
def test_an_in_process_run_with_images_on_qwen2_5_vl(tmp_path):
    """Qwen2.5-VL's placeholder is its image pad, one an image (docs/vision.md)."""
    from client.tools.benchmarks.targets import InProcessTarget
    from qwen2_5_vl import make_qwen2_5_vl_checkpoint
    path = make_qwen2_5_vl_checkpoint(tmp_path / "qwen", seed=1)
    items = make_workload("images", 3, seed=6, vocab_size=512, max_output_len=3)
    target = InProcessTarget(str(path), "inflight", {})
    try:
        pad = target.requests.marker_id
        assert all(target.requests.prompt(w)["prompt_token_ids"].count(pad) == len(w.images) for w in items)
        result = target.run(items, 2)
        stats = target.engine.stats()
    finally:
        target.close()
    assert result["completed"] == 3 and result["failed"] == 0, result["errors"]
    assert stats["encoder_runs_total"] == sum(len(w.images) for w in items) and stats["kv_blocks_used"] == 0
