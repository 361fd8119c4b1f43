"""`inflight import-gguf TEXT.gguf --mmproj MMPROJ.gguf`: a tiny Gemma 3 vision checkpoint split as
llama.cpp's converter splits it (tests/gguf_vision_files.py: the text file and the mmproj file, F16 and
F32 tensors, gguf-py's own tensor names) comes back as a Gemma3ForConditionalGeneration folder: the
same configuration and vision settings, the tower's and projector's tensors bit for bit (the
projector's norm within float32's step at 1: the converter stored 1 + w), and the same greedy tokens
with images, whole and chunked, as the safetensors checkpoint. A wrong mmproj file is refused before
anything is written, naming the key or the tensor."""
import json

import pytest
import torch
from safetensors.torch import load_file

from backend import LLM, SamplingParams
from backend.models.gemma3_vision import read_vision_config
from backend.models.gguf.importer import GGUFImportError, import_gguf, main
from backend.models.loader import load_model_config
from gguf_vision_files import f16_exact_checkpoint, hub_vision_name, write_mmproj, write_text_gguf
from vision_checkpoint import random_image

QUIET = dict(log=lambda *_: None)
BOI = 2000  # <start_of_image> in the checkpoint's tokenizer


@pytest.fixture(scope="module")
def split(tmp_path_factory):
    """(the safetensors checkpoint, the text GGUF, its F16 mmproj, the import of both)."""
    root = tmp_path_factory.mktemp("mmproj")
    hf = f16_exact_checkpoint(root / "hf", seed=5)
    text, mmproj = root / "gemma-3-tiny-F16.gguf", root / "mmproj-gemma-3-tiny-F16.gguf"
    write_text_gguf(text, hf, types=("F16", "F32"))
    write_mmproj(mmproj, hf, ftype="F16")
    return hf, text, mmproj, import_gguf(text, root / "out", mmproj=mmproj, **QUIET)


def test_the_folder_is_the_checkpoints_configuration_and_vision_settings(split):
    hf, _, _, out = split
    ours, theirs = load_model_config(out), load_model_config(hf)
    assert ours.architecture == theirs.architecture == "Gemma3ForConditionalGeneration"
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                  "head_dim", "rope_theta", "rope_scaling", "tie_word_embeddings", "layer_windows",
                  "local_rope_theta", "attention_scale", "final_logit_softcapping", "embedding_scale"):
        assert getattr(ours, field) == getattr(theirs, field), field
    assert read_vision_config(out) == read_vision_config(hf)
    assert read_vision_config(out).mm_tokens_per_image == 9 and read_vision_config(out).boi_token_id == BOI
    processor = json.loads((out / "preprocessor_config.json").read_text())
    assert processor["image_mean"] == processor["image_std"] == [0.5] * 3 and processor["size"]["height"] == 48


@pytest.mark.parametrize("ftype", ["F16", "F32"])
def test_the_vision_tensors_are_the_checkpoints(split, tmp_path, ftype):
    hf, text, _, _ = split
    mmproj = tmp_path / f"mmproj-{ftype}.gguf"
    write_mmproj(mmproj, hf, ftype=ftype)
    out = import_gguf(text, tmp_path / "out", mmproj=mmproj, **QUIET)
    ours = load_file(str(out / "mmproj.safetensors"))
    theirs = {hub_vision_name(k): v for k, v in load_file(str(hf / "model.safetensors")).items() if hub_vision_name(k)}
    assert set(ours) == set(theirs) and len(ours) == 5 + 2 * 16 + 2
    norm = "multi_modal_projector.mm_soft_emb_norm.weight"
    differ = [k for k in theirs if k != norm and not torch.equal(ours[k], theirs[k].float())]
    assert not differ, differ
    assert torch.allclose(ours[norm], theirs[norm], atol=2 ** -23) and torch.equal(ours[norm] + 1, theirs[norm] + 1)


CASES = [  # (token prompt with a BOI per image, images, max_tokens): lengths not block multiples
    ([5, 6, BOI, 7, 8, 9], [random_image(1, 30, 40)], 7),
    ([11, BOI, 12, 13, BOI, 14, 15], [random_image(2, 64, 48, "L"), random_image(3, 48, 48, "RGBA")], 8),
    ([40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52], [], 6),
    ([20, 21, BOI, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33, 34, 35, 36, 37], [random_image(4, 17, 90)], 6),
]


@pytest.mark.slow  # two engines, twice: ~25 s
@pytest.mark.parametrize("chunked", [False, True])
def test_greedy_with_images_equals_the_safetensors_checkpoint(split, chunked):
    hf, _, _, out = split
    prompts = [{"prompt_token_ids": ids, "multi_modal_data": {"image": images}} if images else ids
               for ids, images, _ in CASES]
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for *_, n in CASES]
    kw = dict(kv_block_size=16, max_tokens_in_paged_kv_cache=2048, enable_chunked_context=chunked,
              max_num_batched_tokens=16 if chunked else 512)
    expected = [o.token_ids for o in LLM(str(hf), **kw).generate(prompts, params)]
    llm = LLM(str(out), **kw)
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected
    stats = llm.stats()
    assert stats["encoder_runs_total"] == 4 and stats["kv_blocks_used"] == 0


def test_the_command_line_takes_mmproj(split, tmp_path, capsys):
    _, text, mmproj, _ = split
    assert main([str(text), "--mmproj", str(mmproj), "--out", str(tmp_path / "cli")]) == 0
    assert json.loads((tmp_path / "cli" / "config.json").read_text())["architectures"] == ["Gemma3ForConditionalGeneration"]
    assert main([str(text), "--mmproj", str(tmp_path / "none.gguf"), "--out", str(tmp_path / "x")]) == 2
    assert "no GGUF file at" in capsys.readouterr().err and not (tmp_path / "x").exists()


BAD = {
    "wrong projector type": (dict(projector="llava"),
                             "clip.projector_type is 'llava'; supported: gemma3, qwen2.5vl_merger"),
    "Qwen2.5-VL's projector with a Gemma 3 text model": (
        dict(projector="qwen2.5vl_merger"),
        "a qwen2.5vl_merger projector goes with a qwen2vl text model; the text file's general.architecture is 'gemma3'"),
    "a missing tensor": (dict(skip=["v.blk.1.ffn_down.weight"]), "missing, e.g. v.blk.1.ffn_down.weight"),
    "a transposed projection": (dict(replace={"mm.input_projection.weight": "T"}),
                                "tensor mm.input_projection.weight has shape [64, 32]; the metadata implies [32, 64]"),
    "a position table of another size": (dict(replace={"v.position_embd.weight": "short"}),
                                         "tensor v.position_embd.weight has shape [35, 32]; the metadata implies [36, 32]"),
    "a projection_dim other than the text model's": (dict(keys={"clip.vision.projection_dim": 96}),
                                                     "clip.vision.projection_dim is 96; the text model's hidden size "
                                                     "(gemma3.embedding_length) is 64"),
    "a pool that does not divide the patches": (dict(keys={"clip.vision.projector.scale_factor": 4}),
                                                "clip.vision.projector.scale_factor 4 does not divide the 6 patches"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_wrong_mmproj_is_refused_naming_the_key_or_tensor(split, tmp_path, case):
    hf, text, _, _ = split
    kwargs, words = BAD[case]
    mmproj = tmp_path / "mmproj.gguf"
    if "replace" in kwargs:
        arrays = write_mmproj(tmp_path / "good.gguf", hf)
        edit = {"T": lambda a: a.T.copy(), "short": lambda a: a[:-1].copy()}
        kwargs = {"replace": {k: edit[v](arrays[k]) for k, v in kwargs["replace"].items()}}
    write_mmproj(mmproj, hf, **kwargs)
    with pytest.raises(GGUFImportError) as info:
        import_gguf(text, tmp_path / "out", mmproj=mmproj, **QUIET)
    assert words in str(info.value) and "mmproj.gguf" in str(info.value)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.partial*"))


def test_a_text_file_is_not_an_mmproj_file(split, tmp_path):
    _, text, _, _ = split
    with pytest.raises(GGUFImportError, match=r"general.architecture is 'gemma3'; it must be 'clip'"):
        import_gguf(text, tmp_path / "out", mmproj=text, **QUIET)


def test_a_packed_text_file_with_its_mmproj_serves_images(split, tmp_path):
    """Q8_0 text matrices stay packed beside the float vision tower (quantization_config at the top
    of the multimodal config, where the loader reads it)."""
    hf, _, mmproj, _ = split
    text = tmp_path / "gemma-3-tiny-Q8_0.gguf"
    write_text_gguf(text, hf, types=("Q8_0",))
    out = import_gguf(text, tmp_path / "out", mmproj=mmproj, **QUIET)
    cfg = load_model_config(out)
    assert cfg.architecture == "Gemma3ForConditionalGeneration" and set(cfg.quantized_modules.values()) == {"Q8_0"}
    llm = LLM(str(out), kv_block_size=16, max_tokens_in_paged_kv_cache=1024)
    (o,) = llm.generate([{"prompt_token_ids": CASES[0][0], "multi_modal_data": {"image": CASES[0][1]}}],
                        SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert len(o.token_ids) == 4 and llm.stats()["encoder_runs_total"] == 1
