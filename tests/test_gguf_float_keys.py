"""`inflight import-gguf` writes each float hyperparameter of the file (GGUF stores them as float32)
as the shortest decimal that reads back as the same float32: the checkpoint's 1e-05, not the float32's
9.999999747378752e-06, for the norm epsilon, the RoPE bases, the linear and Llama 3 scaling factors,
Gemma 3's logit soft cap. Files written with the gguf package (tests/gguf_files.py)."""
import json

import gguf
import numpy as np
import pytest

from backend.models.gguf.importer import import_gguf
from backend.models.gguf.mapping import float32_decimal
from gguf_files import SHAPE, llama_cpp_rope_factors, write_gguf, write_gguf_from_hf
from hf_checkpoints import make_checkpoint

QUIET = dict(log=lambda *_: None)


@pytest.fixture(scope="module")
def tokenizer_json(default_model_dir):
    return default_model_dir / "tokenizer.json"


def stored(path, key: str) -> np.float32:
    """The float32 the file holds under `key`."""
    field = gguf.GGUFReader(str(path)).fields[key]
    assert field.types == [gguf.GGUFValueType.FLOAT32], field.types
    return np.float32(field.parts[field.data[0]][0])


def written(out) -> tuple[dict, str]:
    text = (out / "config.json").read_text()
    return json.loads(text), text


def test_float32_decimal_is_the_shortest_round_trip_and_leaves_float64_values_alone():
    assert float32_decimal(np.float32(1e-5)) == 1e-5 and float(np.float32(1e-5)) != 1e-5
    assert float32_decimal(np.float32(0.48145466)) == 0.48145467  # as short, the same float32 (CLIP's mean)
    assert float32_decimal(10000) == 10000.0 and float32_decimal(0.5) == 0.5
    assert float32_decimal(0.1) == 0.1  # a float64 no float32 equals (a FLOAT64 key): as it is
    assert float32_decimal(1e300) == 1e300


def test_llama_eps_rope_base_and_linear_factor_are_the_checkpoints_decimals(tmp_path, tokenizer_json):
    path = tmp_path / "linear.gguf"
    write_gguf(path, tokenizer_json, types=("F32",), raw_metadata={
        "llama.rope.freq_base": 123456.7, "llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 1.7})
    config, text = written(import_gguf(path, tmp_path / "out", **QUIET))
    assert '"rms_norm_eps": 1e-05' in text and '"rope_theta": 123456.7' in text
    assert config["rope_scaling"] == {"rope_type": "linear", "factor": 1.7}
    for key, value in (("llama.attention.layer_norm_rms_epsilon", config["rms_norm_eps"]),
                       ("llama.rope.freq_base", config["rope_theta"]),
                       ("llama.rope.scaling.factor", config["rope_scaling"]["factor"])):
        assert np.float32(value) == stored(path, key) and float(stored(path, key)) != value, key


def test_llama3_rope_freqs_factor_is_the_checkpoints_decimal(tmp_path, tokenizer_json):
    path = tmp_path / "llama3.gguf"
    factors = llama_cpp_rope_factors(SHAPE["head_dim"], 10000.0, 8.3)
    write_gguf(path, tokenizer_json, types=("F32",), extra_tensors={"rope_freqs.weight": factors})
    config, _ = written(import_gguf(path, tmp_path / "out", **QUIET))
    assert config["rope_scaling"]["factor"] == 8.3 and float(factors.max()) != 8.3


def test_gemma3_eps_and_soft_cap_are_the_checkpoints_decimals(tmp_path, tokenizer_json):
    from gguf_files import tokenizer_metadata
    hf_dir = make_checkpoint("gemma3", tmp_path / "hf", seed=2, vocab_size=len(tokenizer_metadata(tokenizer_json)[0]),
                             num_hidden_layers=6, sliding_window_pattern=6, query_pre_attn_scalar=32,
                             rms_norm_eps=1e-6, final_logit_softcapping=30.7)
    path = tmp_path / "gemma3.gguf"
    assert write_gguf_from_hf(path, hf_dir, tokenizer_json) == "gemma3"
    config, text = written(import_gguf(path, tmp_path / "out", **QUIET))
    theirs = json.loads((hf_dir / "config.json").read_text())
    assert config["rms_norm_eps"] == theirs["rms_norm_eps"] == 1e-6 and '"rms_norm_eps": 1e-06' in text
    assert config["final_logit_softcapping"] == theirs["final_logit_softcapping"] == 30.7
    assert np.float32(30.7) == stored(path, "gemma3.final_logit_softcapping")
    assert config["rope_parameters"]["full_attention"]["factor"] == theirs["rope_parameters"]["full_attention"]["factor"]
