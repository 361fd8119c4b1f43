"""`inflight import-gguf TEXT.gguf --mmproj MMPROJ.gguf` for Qwen2.5-VL: a tiny random checkpoint split as
llama.cpp's converter splits it (tests/gguf_qwen_vl_files.py: the qwen2vl text file with its M-RoPE
sections, the qwen2.5vl_merger mmproj with q/k/v and the patch embedding's temporal halves apart)
comes back as a Qwen2_5_VLForConditionalGeneration folder: the same configuration (mrope_section from
the rope sections, the image markers from the vocabulary, the full-attention blocks from
n_wa_pattern), the tower's tensors bit for bit, and the same greedy tokens with images (several
windows each), whole and chunked, as the safetensors checkpoint. A wrong file is refused before
anything is written, naming the key or the tensor."""
import json

import pytest
import torch
from safetensors.torch import load_file

from backend import LLM, SamplingParams
from backend.models.gguf.importer import GGUFImportError, import_gguf
from backend.models.loader import load_model_config
from backend.models.qwen2_5_vl_vision import read_qwen_vision_config
from gguf_qwen_vl_files import MAX_PIXELS, MIN_PIXELS, make_checkpoint, write_mmproj, write_text_gguf
from vision_checkpoint import random_image

QUIET = dict(log=lambda *_: None)
S, E, P = 2000, 2001, 2002  # <|vision_start|>, <|vision_end|>, <|image_pad|> in the checkpoint's tokenizer


@pytest.fixture(scope="module")
def split(tmp_path_factory):
    """(the safetensors checkpoint, the text GGUF, its F16 mmproj, the import of both)."""
    root = tmp_path_factory.mktemp("mmproj_qwen")
    hf = make_checkpoint(root / "hf", seed=5)
    text, mmproj = root / "qwen2.5-vl-tiny-F16.gguf", root / "mmproj-qwen2.5-vl-tiny-F16.gguf"
    write_text_gguf(text, hf, types=("F16", "F32"))
    write_mmproj(mmproj, hf, ftype="F16")
    return hf, text, mmproj, import_gguf(text, root / "out", mmproj=mmproj, **QUIET)


def test_the_folder_is_the_checkpoints_configuration_and_vision_settings(split):
    hf, _, _, out = split
    ours, theirs = load_model_config(out), load_model_config(hf)
    assert ours.checkpoint_architecture == theirs.checkpoint_architecture == "Qwen2_5_VLForConditionalGeneration"
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                  "head_dim", "rope_theta", "rope_scaling", "tie_word_embeddings", "qkv_bias", "mrope_section"):
        assert getattr(ours, field) == getattr(theirs, field), field
    assert ours.mrope_section == (2, 3, 3)
    assert read_qwen_vision_config(out) == read_qwen_vision_config(hf)
    v = read_qwen_vision_config(out)
    assert (v.fullatt_block_indexes, v.window_size, v.image_token_id, v.vision_start_token_id) == ((1,), 112, P, S)
    processor = json.loads((out / "preprocessor_config.json").read_text())
    theirs = json.loads((hf / "preprocessor_config.json").read_text())
    assert processor["image_mean"] == pytest.approx(theirs["image_mean"]) and processor["image_mean"] != [0.5] * 3
    assert (processor["min_pixels"], processor["max_pixels"], processor["patch_size"]) == (MIN_PIXELS, MAX_PIXELS, 14)


@pytest.mark.parametrize("ftype", ["F16", "F32"])
def test_the_vision_tensors_are_the_checkpoints(split, tmp_path, ftype):
    hf, text, _, _ = split
    mmproj = tmp_path / f"mmproj-{ftype}.gguf"
    write_mmproj(mmproj, hf, ftype=ftype)
    out = import_gguf(text, tmp_path / "out", mmproj=mmproj, **QUIET)
    ours = load_file(str(out / "mmproj.safetensors"))
    theirs = {"model." + k: v for k, v in load_file(str(hf / "model.safetensors")).items() if k.startswith("visual.")}
    assert set(ours) == set(theirs) and len(ours) == 1 + 5 + 3 * 12
    differ = [k for k in theirs if ours[k].shape != theirs[k].shape or not torch.equal(ours[k], theirs[k].float())]
    assert not differ, differ


CASES = [  # (token prompt with one pad per image, images (width, height), max_tokens): not block multiples
    ([5, 6, S, P, E, 7, 8, 9], [random_image(1, 200, 150)], 7),
    ([11, S, P, E, 12, 13, S, P, E, 14], [random_image(2, 130, 230, "L"), random_image(3, 60, 90, "RGBA")], 8),
    ([40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52], [], 6),
]


@pytest.mark.parametrize("chunked", [False, True])
def test_greedy_with_images_equals_the_safetensors_checkpoint(split, chunked):
    hf, _, _, out = split
    prompts = [{"prompt_token_ids": ids, "multi_modal_data": {"image": images}} if images else ids
               for ids, images, _ in CASES]
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for *_, n in CASES]
    kw = dict(kv_block_size=16, max_tokens_in_paged_kv_cache=2048, enable_chunked_context=chunked,
              max_num_batched_tokens=64 if chunked else 512)
    expected = [o.token_ids for o in LLM(str(hf), **kw).generate(prompts, params)]
    llm = LLM(str(out), **kw)
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected
    stats = llm.stats()
    assert stats["encoder_runs_total"] == 3 and stats["kv_blocks_used"] == 0


BAD = {
    "a missing temporal half": (dict(skip=["v.patch_embd.weight.1"]), "missing, e.g. v.patch_embd.weight.1"),
    "a transposed merger matrix": (dict(replace={"mm.2.weight": "T"}),
                                   "tensor mm.2.weight has shape [128, 64]; the metadata implies [64, 128]"),
    "no window pattern": (dict(drop=["clip.vision.n_wa_pattern"]), "clip.vision.n_wa_pattern is missing"),
    "a projection_dim other than the text model's": (dict(keys={"clip.vision.projection_dim": 96}),
                                                     "clip.vision.projection_dim is 96; the text model's hidden size "
                                                     "(qwen2vl.embedding_length) is 64"),
    "a window the merged patches do not tile": (dict(keys={"clip.vision.window_size": 100}),
                                                "clip.vision.window_size 100 is not a multiple of"),
    "no SiLU": (dict(keys={"clip.use_silu": False}), "clip.use_silu is False"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_wrong_mmproj_is_refused_naming_the_key_or_tensor(split, tmp_path, case):
    hf, text, _, _ = split
    kwargs, words = BAD[case]
    mmproj = tmp_path / "mmproj.gguf"
    if "replace" in kwargs:
        arrays = write_mmproj(tmp_path / "good.gguf", hf)
        kwargs = {"replace": {k: arrays[k].T.copy() for k in kwargs["replace"]}}
    write_mmproj(mmproj, hf, **kwargs)
    with pytest.raises(GGUFImportError) as info:
        import_gguf(text, tmp_path / "out", mmproj=mmproj, **QUIET)
    assert words in str(info.value) and "mmproj.gguf" in str(info.value)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.partial*"))


def test_rope_sections_that_do_not_cover_the_rotary_half_are_refused(split, tmp_path):
    hf, _, mmproj, _ = split
    text = tmp_path / "text.gguf"
    write_text_gguf(text, hf, sections=[2, 3, 2, 0])
    with pytest.raises(GGUFImportError, match=r"qwen2vl.rope.dimension_sections is \[2, 3, 2, 0\].*head_dim / 2 = 8"):
        import_gguf(text, tmp_path / "out", mmproj=mmproj, **QUIET)
    assert not (tmp_path / "out").exists()


def test_the_text_file_alone_is_a_qwen2_text_model(split, tmp_path):
    """Without its mmproj the qwen2vl file imports as Qwen2ForCausalLM (M-RoPE on text alone is 1-D
    rope); its greedy tokens are the safetensors checkpoint's on a text prompt."""
    hf, text, _, _ = split
    out = import_gguf(text, tmp_path / "out", **QUIET)
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]
    ids, _, n = CASES[2]
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    kw = dict(kv_block_size=16, max_tokens_in_paged_kv_cache=512)
    assert LLM(str(out), **kw).generate([ids], params)[0].token_ids == LLM(str(hf), **kw).generate([ids], params)[0].token_ids


def test_a_packed_text_file_with_its_mmproj_serves_images(split, tmp_path):
    """Q8_0 text matrices stay packed beside the float tower (quantization_config at the top of the
    multimodal config, where the loader reads it); the command line takes the pair."""
    from backend.models.gguf.importer import main
    hf, _, mmproj, _ = split
    text = tmp_path / "qwen2.5-vl-tiny-Q8_0.gguf"
    write_text_gguf(text, hf, types=("Q8_0",))
    assert main([str(text), "--mmproj", str(mmproj), "--out", str(tmp_path / "out")]) == 0
    cfg = load_model_config(tmp_path / "out")
    assert cfg.checkpoint_architecture == "Qwen2_5_VLForConditionalGeneration"
    assert set(cfg.quantized_modules.values()) == {"Q8_0"} and cfg.mrope_section == (2, 3, 3)
    llm = LLM(str(tmp_path / "out"), kv_block_size=16, max_tokens_in_paged_kv_cache=1024)
    (o,) = llm.generate([{"prompt_token_ids": CASES[0][0], "multi_modal_data": {"image": CASES[0][1]}}],
                        SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert len(o.token_ids) == 4 and llm.stats()["encoder_runs_total"] == 1
