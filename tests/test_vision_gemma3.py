"""Gemma 3 vision in the engine (docs/vision.md) against transformers' Gemma3ForConditionalGeneration
on a tiny random checkpoint it wrote (tests/vision_checkpoint.py): greedy tokens equal and
log-probabilities close for one to three images of different sizes and modes in one batch with
text-only requests, whole and chunked prefill (a 16-token budget: chunks cut before 9-token images);
the same image twice encoded once (the encoder cache, and the prefix cache keyed by the image), a
different image reusing nothing; the preprocessing equal to transformers' processor; every bad
input refused naming its field with nothing held afterwards."""
import struct
import zlib

import numpy as np
import pytest
import torch

from backend import LLM, SamplingParams
from backend.core.images import ImageProcessing, decode_data_url, decode_image, preprocess
from vision_checkpoint import (BOI, IMAGE_SIZE, IMAGE_TOKEN, hf_generate, image_bytes, make_vision_checkpoint,
                               oracle_ids, random_image)

CASES = [  # (token prompt with a BOI per image, images, max_tokens)
    ([5, 6, BOI, 7, 8, 9], [random_image(1, 30, 40)], 7),
    ([40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58], [], 6),
    ([11, BOI, 12, 13, BOI, 14], [random_image(2, 64, 48, "L"), random_image(3, 48, 48, "RGBA")], 8),
    ([20, 21, 22, BOI, 23, BOI, 24, 25, BOI, 26],
     [random_image(4, 17, 90), random_image(5, 100, 60), random_image(6, 48, 47)], 6),
    ([60, 61, 62], [], 5),
]


def mm_prompt(ids, images):
    return {"prompt_token_ids": ids, "multi_modal_data": {"image": images}} if images else ids


@pytest.fixture(scope="module")
def vision(tmp_path_factory):
    import transformers as tf
    path = make_vision_checkpoint(tmp_path_factory.mktemp("gemma3-vision"), seed=3)
    model = tf.Gemma3ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    expected = [hf_generate(model, ids, images, n) for ids, images, n in CASES]
    return path, model, expected


def hf_logprobs(model, ids, images, output):
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil
    full = oracle_ids(ids) + output
    kwargs = {}
    if images:
        proc = Gemma3ImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
        kwargs = {"pixel_values": proc(images, return_tensors="pt")["pixel_values"],
                  "token_type_ids": torch.tensor([[int(t == IMAGE_TOKEN) for t in full]])}
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([full]), **kwargs).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[len(full) - len(output) - 1:-1]


@pytest.mark.slow  # the module's checkpoint and transformers' outputs: ~12 s once
@pytest.mark.parametrize("chunked", [False, True])
def test_images_and_text_in_one_batch_match_transformers(vision, chunked):
    path, model, expected = vision
    llm = LLM(str(path), kv_block_size=16, max_tokens_in_paged_kv_cache=2048, enable_chunked_context=chunked,
              max_num_batched_tokens=16 if chunked else 512)
    outputs = llm.generate([mm_prompt(ids, images) for ids, images, _ in CASES],
                           [SamplingParams(max_tokens=n, temperature=0, logprobs=2) for _, _, n in CASES])
    assert [o.token_ids for o in outputs] == expected
    worst = 0.0
    for (ids, images, _), out in zip(CASES, outputs):
        ref = hf_logprobs(model, ids, images, out.token_ids)
        for step, entries in enumerate(out.logprobs):
            worst = max(worst, max(abs(lp.logprob - float(ref[step, tok])) for tok, lp in entries.items()))
    assert worst < 1e-4, f"log-probabilities differ from transformers' by up to {worst:.2e}"
    stats = llm.stats()
    assert stats["kv_blocks_used"] == 0 and stats["encoder_runs_total"] == 6
    llm.check_integrity()


@pytest.mark.slow
def test_the_same_image_twice_is_encoded_once_and_its_blocks_reused(vision):
    path, model, _ = vision
    llm = LLM(str(path), kv_block_size=4, max_tokens_in_paged_kv_cache=1024)
    prompt, params = [5, BOI, 6, 7, 8, 9, 10], SamplingParams(max_tokens=5, temperature=0)
    first = llm.generate([mm_prompt(prompt, [random_image(7, 40, 30)])], params)[0]
    hits = llm.stats()["prefix_cache_hit_tokens"]
    again = llm.generate([mm_prompt(prompt, [random_image(7, 40, 30)])], params)[0]  # equal pixels, new object
    stats = llm.stats()
    assert again.token_ids == first.token_ids
    assert stats["encoder_runs_total"] == 1
    assert stats["prefix_cache_hit_tokens"] - hits >= 12  # the blocks over BOI + the image's 9 tokens
    hits = stats["prefix_cache_hit_tokens"]
    other = llm.generate([mm_prompt(prompt, [random_image(8, 40, 30)])], params)[0]
    stats = llm.stats()
    assert stats["prefix_cache_hit_tokens"] == hits, "a different image reused a block"
    assert stats["encoder_runs_total"] == 2
    assert other.token_ids == hf_generate(model, prompt, [random_image(8, 40, 30)], 5)
    assert stats["kv_blocks_used"] == 0


@pytest.mark.slow
def test_without_prefix_caching_the_encoder_cache_serves_the_second_request(vision):
    path, _, _ = vision
    llm = LLM(str(path), kv_block_size=16, max_tokens_in_paged_kv_cache=1024, enable_kv_cache_reuse=False)
    prompt = mm_prompt([5, BOI, 6], [random_image(9, 20, 20)])
    outs = [llm.generate([prompt], SamplingParams(max_tokens=3, temperature=0))[0] for _ in range(2)]
    stats = llm.stats()
    assert outs[0].token_ids == outs[1].token_ids
    assert (stats["encoder_runs_total"], stats["encoder_cache_hits_total"]) == (1, 1)
    assert stats["encoder_cache_bytes"] == 9 * 64 * 4  # one image: 9 rows of the text model's 64, float32


@pytest.mark.parametrize("mode", ["RGB", "L", "RGBA"])
def test_preprocessing_equals_transformers_processor(mode):
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil
    image = random_image(11, 70, 33, mode)
    ours = preprocess(image, ImageProcessing(size=IMAGE_SIZE))
    theirs = Gemma3ImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})([image], return_tensors="np")
    np.testing.assert_allclose(ours, theirs["pixel_values"][0], atol=1e-6)


def _png_claiming(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height (its pixel data a 1x1 image's)."""
    data = bytearray(image_bytes(random_image(0, 1, 1)))
    ihdr = bytearray(data[12:29])
    ihdr[4:12] = struct.pack(">II", width, height)
    data[12:29] = ihdr
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(ihdr)))
    return bytes(data)


@pytest.mark.parametrize("data, words", [
    (b"", "empty"),
    (b"not an image at all", "not a PNG, JPEG or WebP"),
    (image_bytes(random_image(0, 8, 8), "GIF"), "not a PNG, JPEG or WebP"),
    (image_bytes(random_image(0, 40, 40))[:-30], "corrupt or truncated"),
    (_png_claiming(60_000, 60_000), "decompression bomb"),
    (_png_claiming(0, 5), "not a PNG, JPEG or WebP|at least 1 pixel"),
])
def test_bad_image_bytes_are_refused_naming_the_field(data, words):
    with pytest.raises(ValueError, match=words) as info:
        decode_image(data, "image[0]")
    assert str(info.value).startswith("image[0]")


def test_data_urls_take_png_jpeg_webp_only():
    png = image_bytes(random_image(0, 5, 5))
    import base64
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    assert decode_data_url(url, "f").size == (5, 5)
    for fmt, mime in (("JPEG", "jpeg"), ("WEBP", "webp")):
        blob = base64.b64encode(image_bytes(random_image(0, 6, 4), fmt)).decode()
        assert decode_data_url(f"data:image/{mime};base64,{blob}", "f").size == (6, 4)
    with pytest.raises(ValueError, match="unsupported image type 'image/gif'"):
        decode_data_url("data:image/gif;base64,R0lG", "messages[0].content[1].image_url")
    with pytest.raises(ValueError, match="not valid base64"):
        decode_data_url("data:image/png;base64,@@@", "f")


@pytest.mark.slow
def test_bad_requests_are_refused_and_nothing_is_held(vision, default_model_dir):
    path, model, _ = vision
    llm = LLM(str(path), kv_block_size=16, max_tokens_in_paged_kv_cache=1024, limit_mm_per_prompt='{"image": 2}')
    params = SamplingParams(max_tokens=2, temperature=0)
    img = random_image(1, 10, 10)
    bad = [
        (mm_prompt([5, BOI, BOI, BOI], [img] * 3), "3 images in one prompt; the limit is 2"),
        (mm_prompt([5, BOI, 6], [img, img]), "1 image placeholders"),
        (mm_prompt([5, IMAGE_TOKEN, BOI], [img]), "image token 500 appears"),
        (mm_prompt([5, BOI], [b"\x89PNG broken"]), r"image\[0\]: not a PNG"),
        (mm_prompt([5, BOI], ["a string"]), r"image\[0\]: an image must be"),
        ({"prompt_token_ids": [5], "multi_modal_data": {"audio": [b""]}}, "only 'image'"),
    ]
    for prompt, words in bad:
        with pytest.raises(ValueError, match=words):
            llm.generate([prompt], params)
    assert llm.stats()["kv_blocks_used"] == 0 and llm.stats()["num_requests_waiting"] == 0
    assert llm.generate([mm_prompt([5, BOI, 6], [img])], params)[0].token_ids == hf_generate(model, [5, BOI, 6], [img], 2)
    text_only = LLM(str(default_model_dir), max_tokens_in_paged_kv_cache=256)
    with pytest.raises(ValueError, match="this model takes no images"):
        text_only.generate([mm_prompt([5, 6], [img])], params)
    assert text_only.stats()["kv_blocks_used"] == 0


def test_chunks_end_outside_images_and_within_the_encoder_budget():
    from types import SimpleNamespace
    from backend.core.multimodal import EncoderBudget, ImageItem, chunk_end, image_chunk, keyed_tokens
    items = [ImageItem("a" * 64, 3, 9), ImageItem("b" * 64, 14, 9)]  # tokens 3-11 and 14-22
    assert [chunk_end(items, 0, n) for n in (3, 5, 12, 13, 16, 23)] == [3, 3, 12, 13, 14, 23]
    assert chunk_end(items, 6, 3) == 0 and chunk_end(items, 6, 6) == 6  # a prefix hit inside the first image
    budget = EncoderBudget(SimpleNamespace(max_num_encoder_input_tokens=10, max_num_batched_tokens=64))
    assert image_chunk(items, 0, 30, budget) == 14 and budget.left == 1  # the second image waits
    assert image_chunk(items, 14, 9, budget) == 0
    budget.reset()
    assert image_chunk(items, 14, 9, budget) == 9 and budget.left == 1
    budget.reset()
    assert image_chunk(items, 0, 5, budget) == 3  # a paced chunk of 5 tokens: cut before the image...
    budget.room = 12
    assert image_chunk(items, 3, 5, budget) == 9  # ...and taken whole when the step has room for it
    budget.reset()
    budget.room = 8
    assert image_chunk(items, 3, 5, budget) == 0
    # an image taken whole past the pacer's cap leaves the cap negative for the next request: no chunk
    # (a negative one reached the worker, found running the chunked case alone)
    from backend.sched.admission import chunk
    req = SimpleNamespace(num_tokens=40, num_computed_tokens=4, mm_items=items)
    config = SimpleNamespace(enable_chunked_context=True, max_num_batched_tokens=16)
    assert chunk(req, -3, config) == 0 and chunk(SimpleNamespace(**{**vars(req), "mm_items": []}), -3, config) == 0
    keyed = keyed_tokens(list(range(30)), items)
    assert keyed[:3] == [0, 1, 2] and keyed[12:14] == [12, 13] and all(t < 0 for t in keyed[3:12] + keyed[14:23])
    assert keyed_tokens(list(range(30)), [ImageItem("c" * 64, 3, 9)])[3:12] != keyed[3:12]


@pytest.mark.slow
def test_a_paced_step_still_takes_an_image_whole(vision):
    """Prefill pacing caps a step's prompt tokens while others decode (a 0.001 ms target: the floor,
    a token or so a step); an image's 9 tokens never fit that cap, so they run whole within the
    step's room instead of waiting for the decodes to end."""
    path, model, _ = vision
    llm = LLM(str(path), kv_block_size=16, max_tokens_in_paged_kv_cache=2048, inter_token_target_ms=0.001)
    engine, greedy = llm.engine, SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    for i in range(3):
        engine.add_request(f"text{i}", [30 + i, 31, 32, 33], greedy)
    for _ in range(6):
        engine.step()
    prompt = [5, 6, 7, 8, BOI, 9]
    engine.add_request("image", mm_prompt(prompt, [random_image(12, 20, 20)]), SamplingParams(max_tokens=3, temperature=0))
    done = {}
    for _ in range(40):
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        if "image" in done:
            break
    assert "image" in done and not any(k.startswith("text") for k in done), "the image request waited for the decodes"
    assert done["image"].token_ids == hf_generate(model, prompt, [random_image(12, 20, 20)], 3)


def test_the_encoder_cache_comes_back_within_its_budget_once_its_images_are_unpinned():
    """Pinned entries may take the cache past its budget; the next step's trim (VisionStep.prepare)
    evicts the unpinned ones back under it (tests/e2e/test_mixed_load_served.py under load)."""
    from backend.worker.vision import EncoderCache

    cache = EncoderCache(budget_bytes=2 * 4 * 9)  # two entries of 9 floats
    for key in "abc":
        cache.put(key, torch.zeros(9), pinned={"a", "b", "c"})
    assert cache.bytes == 3 * 36 and list(cache.entries) == ["a", "b", "c"]
    cache.trim(pinned={"a"})
    assert cache.bytes == 2 * 36 and list(cache.entries) == ["a", "c"]  # the oldest unpinned goes first
