"""Qwen2.5-VL in the engine (docs/vision.md) against transformers' Qwen2_5_VLForConditionalGeneration
on a tiny random checkpoint it wrote (tests/qwen2_5_vl.py): M-RoPE positions and rotation equal to
transformers' (get_rope_index, the rotary embedding), the encoder's rows equal to its image
features (dynamic resolution, window and full attention), greedy tokens equal and log-probabilities
close for one to three images of different sizes in one batch with text-only requests, whole and
chunked prefill; the same image twice encoded once with its blocks reused; bad inputs refused."""
import numpy as np
import pytest
import torch

from backend import LLM, SamplingParams
from backend.core.multimodal import ImageItem
from backend.models.mrope import mrope_delta, mrope_positions, mrope_reference, mrope_rows
from backend.models.rope import rope_cos_sin, rope_inv_freq
from qwen2_5_vl import (IMAGE_PAD, VISION_END, VISION_START, hf_generate, hf_logprobs, make_qwen2_5_vl_checkpoint,
                        oracle_inputs, processor)
from vision_checkpoint import random_image

S, E, P = VISION_START, VISION_END, IMAGE_PAD
CASES = [  # (token prompt with one pad per image, images (width, height) not multiples of 8, max_tokens)
    ([5, 6, S, P, E, 7, 8, 9], [random_image(1, 30, 41)], 7),
    ([40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58], [], 6),
    ([11, S, P, E, 12, 13, S, P, E, 14], [random_image(2, 66, 45, "L"), random_image(3, 50, 50, "RGBA")], 8),
    ([20, 21, 22, S, P, E, 23, S, P, E, 24, 25, S, P, E, 26],
     [random_image(4, 17, 90), random_image(5, 100, 61), random_image(6, 13, 11)], 6),
    ([60, 61, 62], [], 5),
]


def mm_prompt(ids, images):
    return {"prompt_token_ids": ids, "multi_modal_data": {"image": images}} if images else ids


@pytest.fixture(scope="module")
def qwen_vl(tmp_path_factory):
    import transformers as tf
    path = make_qwen2_5_vl_checkpoint(tmp_path_factory.mktemp("qwen2_5_vl"), seed=5)
    model = tf.Qwen2_5_VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    return path, model


@pytest.fixture(scope="module")
def hf_modeling():
    """transformers' Qwen2.5-VL modeling module (imported once: a few seconds)."""
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl
    return modeling_qwen2_5_vl


def test_mrope_rows_rotate_as_transformers(hf_modeling):
    """mrope_rows through each CPU rotary kernel (positions 0..T-1 into the step's own rows) equals
    transformers' M-RoPE (its rotary embedding and apply_rotary_pos_emb) and mrope_reference."""
    from kernels.dispatch import get_ops
    section, head_dim, t = (2, 3, 3), 16, 37
    m = hf_modeling
    cfg = m.Qwen2_5_VLTextConfig(hidden_size=64, num_attention_heads=4, rope_parameters={
        "rope_type": "default", "rope_theta": 10_000.0, "mrope_section": list(section)})
    gen = torch.Generator().manual_seed(0)
    pos = torch.randint(0, 300, (3, t), generator=gen)
    q, k = torch.randn(t, 4, head_dim, generator=gen), torch.randn(t, 2, head_dim, generator=gen)
    cos_hf, sin_hf = m.Qwen2_5_VLRotaryEmbedding(cfg)(q, pos[:, None, :])
    q_hf, k_hf = m.apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos_hf, sin_hf)
    q_hf, k_hf = q_hf[0].transpose(0, 1), k_hf[0].transpose(0, 1)
    cos, sin = rope_cos_sin(head_dim, 512, 10_000.0)
    rows = mrope_rows(cos, sin, pos, section)
    for ops in (get_ops("torch", torch.device("cpu")), get_ops("auto", torch.device("cpu"))):
        q_ours, k_ours = ops.rotary_embedding(q, k, torch.arange(t), *rows)
        torch.testing.assert_close(q_ours, q_hf, atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(k_ours, k_hf, atol=2e-5, rtol=1e-5)
    q_ref, k_ref = mrope_reference(q, k, pos, rope_inv_freq(head_dim, 10_000.0), section)
    torch.testing.assert_close(q_ref, q_hf, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(k_ref, k_hf, atol=2e-5, rtol=1e-5)
    same = pos[0].expand(3, t)  # equal streams: the 1-D rotation at that position
    q_1d, _ = get_ops("torch", torch.device("cpu")).rotary_embedding(q, k, pos[0], cos, sin)
    torch.testing.assert_close(get_ops("torch", torch.device("cpu")).rotary_embedding(
        q, k, torch.arange(t), *mrope_rows(cos, sin, same, section))[0], q_1d)


def test_mrope_positions_equal_get_rope_index(qwen_vl):
    """Whole prompts and every chunk of them: transformers' get_rope_index and its rope delta."""
    path, model = qwen_vl
    for prompt, images, _ in CASES:
        ids, kwargs = oracle_inputs(path, prompt, images)
        if not images:
            assert mrope_delta([]) == 0 and (mrope_positions([], 3, 5) == np.arange(3, 8)).all()
            continue
        theirs, delta = model.model.get_rope_index(torch.tensor([ids]), image_grid_thw=kwargs["image_grid_thw"],
                                                   mm_token_type_ids=kwargs["mm_token_type_ids"])
        grids = (kwargs["image_grid_thw"][:, 1:] // 2).tolist()
        runs = [i for i in range(len(ids)) if ids[i] == P and (i == 0 or ids[i - 1] != P)]
        items = [ImageItem("x", at, gh * gw, None, (gh, gw)) for at, (gh, gw) in zip(runs, grids)]
        ours = mrope_positions(items, 0, len(ids))
        assert (ours == theirs[:, 0].numpy()).all()
        assert mrope_delta(items) == int(delta)
        for start in range(0, len(ids), 7):  # a chunk from anywhere is the same slice
            assert (mrope_positions(items, start, 7)[:, :len(ids) - start] == ours[:, start:start + 7]).all()
        assert (mrope_positions(items, len(ids), 3) == np.arange(len(ids), len(ids) + 3) + int(delta)).all()


def test_the_encoder_equals_transformers_image_features(qwen_vl):
    """Our preprocessing (smart resize, bicubic, CLIP normalization) and encoder (patches seen twice,
    2-D rotary, windows and full attention, merger) against the processor and the HF encoder."""
    from types import SimpleNamespace

    from backend.engine.qwen2_5_vl_images import QwenImageFront
    from backend.models.qwen2_5_vl_vision import load_qwen_vision_encoder, read_qwen_vision_config
    path, model = qwen_vl
    front = QwenImageFront(read_qwen_vision_config(path), str(path), SimpleNamespace(
        limit_mm_per_prompt=4, max_num_encoder_input_tokens=0, max_num_batched_tokens=512))
    encoder = load_qwen_vision_encoder(path, torch.device("cpu"))
    images = [random_image(1, 30, 41), random_image(5, 100, 61), random_image(2, 66, 45, "L"), random_image(6, 13, 11),
              random_image(3, 50, 50, "RGBA"), random_image(7, 200, 9)]
    _, kwargs = oracle_inputs(path, [P] * len(images), images)
    with torch.no_grad():
        theirs = model.model.get_image_features(kwargs["pixel_values"], kwargs["image_grid_thw"]).pooler_output
        prepared = [front.prepare(image, "image[0]") for image in images]
        ours = encoder([torch.from_numpy(pixels) for pixels, _ in prepared])
    assert [list(grid) for _, grid in prepared] == (kwargs["image_grid_thw"][:, 1:] // 2).tolist()
    assert len({grid for _, grid in prepared}) == len(images)  # every size differs
    proc = processor(path)  # our pixels, cut into patches the processor's way, are its pixel_values
    patches = np.concatenate([proc.patchify(pixels, 4, 2, 2)[0] for pixels, _ in prepared])
    np.testing.assert_allclose(patches, kwargs["pixel_values"].numpy(), atol=1e-6)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.slow  # the engine twice and transformers' outputs: ~20 s
@pytest.mark.parametrize("chunked", [False, True])
def test_images_and_text_in_one_batch_match_transformers(qwen_vl, chunked):
    path, model = qwen_vl
    expected = [hf_generate(model, path, ids, images, n) for ids, images, n in CASES]
    llm = LLM(str(path), kv_block_size=16, max_tokens_in_paged_kv_cache=2048, enable_chunked_context=chunked,
              max_num_batched_tokens=64 if chunked else 512)
    outputs = llm.generate([mm_prompt(ids, images) for ids, images, _ in CASES],
                           [SamplingParams(max_tokens=n, temperature=0, logprobs=2) for _, _, n in CASES])
    assert [o.token_ids for o in outputs] == expected
    worst = 0.0
    for (ids, images, _), out in zip(CASES, outputs):
        ref = hf_logprobs(model, path, ids, images, out.token_ids)
        for step, entries in enumerate(out.logprobs):
            worst = max(worst, max(abs(lp.logprob - float(ref[step, tok])) for tok, lp in entries.items()))
    assert worst < 1e-4, f"log-probabilities differ from transformers' by up to {worst:.2e}"
    stats = llm.stats()
    assert stats["kv_blocks_used"] == 0 and stats["encoder_runs_total"] == 6
    llm.check_integrity()


@pytest.mark.slow
def test_the_same_image_twice_is_encoded_once_and_its_blocks_reused(qwen_vl):
    path, model = qwen_vl
    llm = LLM(str(path), kv_block_size=4, max_tokens_in_paged_kv_cache=1024)
    prompt, params = [5, S, P, E, 6, 7, 8, 9, 10], SamplingParams(max_tokens=5, temperature=0)
    first = llm.generate([mm_prompt(prompt, [random_image(7, 40, 30)])], params)[0]  # 20 image tokens
    hits = llm.stats()["prefix_cache_hit_tokens"]
    again = llm.generate([mm_prompt(prompt, [random_image(7, 40, 30)])], params)[0]  # equal pixels, new object
    stats = llm.stats()
    assert again.token_ids == first.token_ids == hf_generate(model, path, prompt, [random_image(7, 40, 30)], 5)
    assert stats["encoder_runs_total"] == 1
    assert stats["prefix_cache_hit_tokens"] - hits >= 24  # the blocks over S + the image's 20 tokens + E
    hits = stats["prefix_cache_hit_tokens"]
    other = llm.generate([mm_prompt(prompt, [random_image(8, 40, 30)])], params)[0]
    stats = llm.stats()
    assert stats["prefix_cache_hit_tokens"] - hits < 4, "a different image reused a block past the text before it"
    assert stats["encoder_runs_total"] == 2
    assert other.token_ids == hf_generate(model, path, prompt, [random_image(8, 40, 30)], 5)
    assert stats["kv_blocks_used"] == 0


@pytest.mark.slow
def test_bad_requests_are_refused_and_nothing_is_held(qwen_vl):
    path, model = qwen_vl
    llm = LLM(str(path), kv_block_size=16, max_tokens_in_paged_kv_cache=1024, limit_mm_per_prompt=2,
              max_num_encoder_input_tokens=32)
    params = SamplingParams(max_tokens=2, temperature=0)
    img = random_image(1, 10, 10)
    bad = [
        (mm_prompt([5, P, P, P], [img] * 3), "3 images in one prompt; the limit is 2"),
        (mm_prompt([5, P, 6], [img, img]), r"1 image placeholders \(<\|image_pad\|>, token 500\) for 2 images"),
        (mm_prompt([5, P], [random_image(2, 1000, 4)]), r"image\[0\]: the image is 1000x4; its aspect ratio"),
        (mm_prompt([5, P], [random_image(3, 64, 64)]), r"image\[0\]: the image takes 64 tokens at 64x64, more than"),
        (mm_prompt([5, P], [b"\x89PNG broken"]), r"image\[0\]: not a PNG"),
        (mm_prompt([5, P], ["a string"]), r"image\[0\]: an image must be"),
    ]
    for prompt, words in bad:
        with pytest.raises(ValueError, match=words):
            llm.generate([prompt], params)
    stats = llm.stats()
    assert stats["kv_blocks_used"] == 0 and stats["num_requests_waiting"] == 0 and stats["encoder_cache_bytes"] == 0
    good = llm.generate([mm_prompt([5, P, 6], [img])], params)[0].token_ids
    assert good == hf_generate(model, path, [5, P, 6], [img], 2)


def test_mrope_section_must_cover_the_rotary_half(tmp_path):
    import json

    from backend.models.checkpoint_config import CheckpointConfigError
    from backend.models.loader import load_model_config
    path = make_qwen2_5_vl_checkpoint(tmp_path, seed=1)
    cfg = load_model_config(path)
    assert (cfg.mrope_section, cfg.architecture, cfg.qkv_bias, cfg.head_dim) == \
        ((2, 3, 3), "Qwen2ForCausalLM", True, 16)
    raw = json.loads((path / "config.json").read_text())
    raw["text_config"]["rope_parameters"]["mrope_section"] = [4, 3, 3]
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointConfigError,
                       match=r"mrope_section \[4, 3, 3\] sums to 10; it must sum to head_dim / 2 = 8"):
        load_model_config(path)


def hub_layout(src, dst):
    """The tiny checkpoint as the Hub's Qwen2.5-VL files lay it out (transformers 4's): the text keys at
    the top of config.json with rope_scaling {"type": "mrope"}, tensors under model.* and visual.*,
    preprocessor_config.json with min_pixels / max_pixels."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file
    cfg = json.loads((src / "config.json").read_text())
    text = cfg.pop("text_config")
    rope = text.pop("rope_parameters")
    flat = {**cfg, **text, "rope_theta": rope["rope_theta"],
            "rope_scaling": {"type": "mrope", "mrope_section": rope["mrope_section"]}}
    dst.mkdir()
    (dst / "config.json").write_text(json.dumps(flat))
    tensors = load_file(str(src / "model.safetensors"))
    save_file({k.replace("model.language_model.", "model.").replace("model.visual.", "visual."): v
               for k, v in tensors.items()}, str(dst / "model.safetensors"))
    proc = json.loads((src / "preprocessor_config.json").read_text())
    size = proc.pop("size")
    (dst / "preprocessor_config.json").write_text(json.dumps({**proc, "min_pixels": size["shortest_edge"],
                                                              "max_pixels": size["longest_edge"]}))
    shutil.copy(src / "generation_config.json", dst / "generation_config.json")
    return dst


@pytest.mark.slow
def test_the_hubs_file_layout_serves_the_same(qwen_vl, tmp_path):
    path, model = qwen_vl
    hub = hub_layout(path, tmp_path / "hub")
    from safetensors import safe_open
    with safe_open(str(hub / "model.safetensors"), "pt") as f:
        assert "visual.merger.mlp.0.weight" in f.keys() and "model.layers.0.mlp.up_proj.weight" in f.keys()
    ids, images, n = CASES[2]
    out = LLM(str(hub), kv_block_size=16, max_tokens_in_paged_kv_cache=1024).generate(
        [mm_prompt(ids, images)], SamplingParams(max_tokens=n, temperature=0))[0]
    assert out.token_ids == hf_generate(model, path, ids, images, n)


@pytest.mark.slow
def test_decode_steps_keep_one_dimensional_positions(qwen_vl, monkeypatch):
    """Only a step that computes image rows gets tables of its own (the Python layers); decode steps
    keep the model's tables (CUDA graphs, the C stack) at the shifted positions. Two completions of
    one image prompt (n=2, each its own sequence with the image) both equal transformers."""
    from backend.worker import mrope_step
    path, model = qwen_vl
    seen = []
    real = mrope_step.step_rope

    def spy(runner, plan, step, empty_rows):
        out = real(runner, plan, step, empty_rows)
        seen.append((bool(plan.prefills), out is not None, step.positions.tolist()))
        return out
    monkeypatch.setattr(mrope_step, "step_rope", spy)
    llm = LLM(str(path), kv_block_size=16, max_tokens_in_paged_kv_cache=1024)
    prompt, image = [5, S, P, E, 6], random_image(9, 30, 41)  # 20 image tokens in a 5 x 4 grid: delta -15
    outs = llm.generate([mm_prompt(prompt, [image])], SamplingParams(max_tokens=4, temperature=0, n=2))[0]
    expected = hf_generate(model, path, prompt, [image], 4)
    assert [c.token_ids for c in outs.samples] == [expected, expected]
    assert any(prefill and own for prefill, own, _ in seen)
    decodes = [positions for prefill, own, positions in seen if not prefill and not own]
    # one-token rows after the image (a second completion computes the prompt's last tokens so): p - 15
    assert decodes and all(22 - 15 <= p < 24 + 4 - 15 for positions in decodes for p in positions if p)
    assert not any(own for prefill, own, _ in seen if not prefill)
