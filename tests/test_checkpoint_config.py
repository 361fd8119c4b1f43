"""A checkpoint's configuration, from config.json or a GGUF file's metadata, checked in one place
(backend/models/checkpoint_config.py, its counts against the weights in weight_shapes.py) before
anything is allocated: every refusal is one line naming the key, its value and the rule (issue 46,
causes 5, 6, 7, 12 and 15; docs/reliability.md). The checkpoints are the tiny random ones of
`inflight make-model` and tests/gguf_files.py, with one value changed; `inflight serve` shows the
same ValueError line (model_repository/llm/1/model.py turns it into the load error).
"""
import json
import math
import time

import pytest

from backend.models.gguf.checks import MAX_CONTEXT_LENGTH
from backend.models.gguf.importer import main as import_gguf
from backend.models.loader import load_model_config
from backend.models.make_model import make_model
from gguf_files import write_gguf

NAN = float("nan")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A two-layer random Llama checkpoint."""
    return make_model(tmp_path_factory.mktemp("tiny"), num_hidden_layers=2)


def variant(tiny, folder, generation=None, **changes):
    """`tiny`'s checkpoint in `folder` (its weights linked) with config.json's `changes` (None deletes
    a key) and, given, generation_config.json's."""
    folder.mkdir()
    for f in tiny.iterdir():
        if f.name not in ("config.json", "generation_config.json"):
            (folder / f.name).symlink_to(f)
    for name, update in (("config.json", changes), ("generation_config.json", generation or {})):
        cfg = json.loads((tiny / name).read_text())
        cfg.update(update)
        (folder / name).write_text(json.dumps({k: v for k, v in cfg.items() if v is not None}))
    return folder


def gemma3(folder, **changes):
    """A Gemma 3 config.json alone (transformers' defaults fill the rest; no weights to check)."""
    folder.mkdir()
    cfg = {"architectures": ["Gemma3ForCausalLM"], "num_hidden_layers": 2, **changes}
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def refused(path, *words):
    """load_model_config refuses `path` with one ValueError line holding every one of `words`."""
    with pytest.raises(ValueError) as info:
        load_model_config(path)
    message = str(info.value)
    assert "\n" not in message and all(w in message for w in words), message
    return message


# -- cause 5: numbers that load and then serve NaN or fail every request ---------------------------

@pytest.mark.parametrize("key,value,words", [
    ("rms_norm_eps", -1e-6, "config.json: rms_norm_eps is -1e-06; it must be a finite number > 0 and < 1"),
    ("rms_norm_eps", NAN, "config.json: rms_norm_eps is nan; it must be a finite number > 0"),
    ("rope_scaling", {"rope_type": "linear", "factor": 0}, "rope_scaling.factor is 0; it must be a finite number >= 1"),
    ("rope_theta", -10000.0, "rope_theta is -10000.0; it must be a finite number > 0"),
    ("rope_theta", 0, "rope_theta is 0; it must be a finite number > 0"),  # once taken as the default 10,000
])
def test_llama_numbers_that_would_compute_nan_are_refused(tiny, tmp_path, key, value, words):
    refused(variant(tiny, tmp_path / "c", **{key: value}), words)


@pytest.mark.parametrize("key,value,words", [
    ("final_logit_softcapping", NAN, "config.json: final_logit_softcapping is nan; it must be a finite number > 0"),
    ("query_pre_attn_scalar", -32, "config.json: query_pre_attn_scalar is -32; it must be a finite number > 0"),
    ("sliding_window", -1, "config.json: sliding_window is -1; it must be a positive integer"),
])
def test_gemma3_numbers_that_would_compute_nan_are_refused(tmp_path, key, value, words):
    refused(gemma3(tmp_path / "g", **{key: value}), words)


def test_the_engine_refuses_them_in_one_line_before_loading(tiny, tmp_path):
    """What `inflight serve` shows: the engine's ValueError, one line (model.py: "inflight: ...")."""
    from backend import LLM
    with pytest.raises(ValueError, match=r"^config.json: rms_norm_eps is nan; it must be a finite number > 0"):
        LLM(str(variant(tiny, tmp_path / "c", rms_norm_eps=NAN)))


# -- cause 6: counts the weights do not back, refused before anything is allocated ----------------

@pytest.mark.parametrize("key,value,words", [
    ("num_hidden_layers", 1_000_000, "config.json: num_hidden_layers is 1000000; it must be at most 2, the layers"),
    ("vocab_size", 10**9, "config.json: vocab_size is 1000000000; it must be 2000, as the weights' embed_tokens"),
    ("intermediate_size", 10**7, "config.json: intermediate_size is 10000000; it must be 688"),
    ("num_attention_heads", 4096, "num_attention_heads 4096 x head_dim is 131072; it must be 256"),
])
def test_counts_are_held_to_the_weights_at_once(tiny, tmp_path, key, value, words):
    path = variant(tiny, tmp_path / "c", **{key: value})
    start = time.process_time()
    refused(path, words)
    from backend import LLM
    with pytest.raises(ValueError, match=key):
        LLM(str(path))
    assert time.process_time() - start < 5


# -- cause 7: positions capped on both paths by one rule ------------------------------------------

def test_positions_are_capped_as_the_gguf_path_caps_them(tiny, tmp_path):
    refused(variant(tiny, tmp_path / "big", max_position_embeddings=2**40),
            f"config.json: max_position_embeddings is 1099511627776; it must be an integer in 1..{MAX_CONTEXT_LENGTH}")
    from backend.models import checkpoint_config
    assert MAX_CONTEXT_LENGTH is checkpoint_config.MAX_CONTEXT_LENGTH == 1 << 20  # one constant, re-exported
    assert load_model_config(variant(tiny, tmp_path / "edge", max_position_embeddings=MAX_CONTEXT_LENGTH)) \
        .max_position_embeddings == MAX_CONTEXT_LENGTH


# -- cause 12: values of the wrong type, named ----------------------------------------------------

@pytest.mark.parametrize("arch,key,value,words", [
    ("MistralForCausalLM", "sliding_window", "x", "config.json: sliding_window is 'x'; it must be a positive integer"),
    ("LlamaForCausalLM", "num_attention_heads", -4, "config.json: num_attention_heads is -4; it must be a positive integer"),
    ("LlamaForCausalLM", "num_key_value_heads", "2", "config.json: num_key_value_heads is '2'"),
    ("LlamaForCausalLM", "rope_scaling", "linear", "config.json: rope_scaling is 'linear'; it must be a JSON object"),
])
def test_wrong_types_in_config_json_are_named(tiny, tmp_path, arch, key, value, words):
    refused(variant(tiny, tmp_path / "c", architectures=[arch], **{key: value}), words)


@pytest.fixture(scope="module")
def tokenizer_json(tiny):
    return tiny / "tokenizer.json"


def gguf_refused(tmp_path, tokenizer_json, arch, raw, words):
    """`inflight import-gguf` of a tiny `arch` file with the metadata `raw` exits 2 with one line."""
    path = tmp_path / "x.gguf"
    write_gguf(path, tokenizer_json, arch=arch, types=("F32",), raw_metadata=raw)
    out = tmp_path / "out"
    import io
    from contextlib import redirect_stderr
    err = io.StringIO()
    with redirect_stderr(err):
        assert import_gguf([str(path), "--out", str(out)]) == 2
    assert err.getvalue().count("\n") == 1 and words in err.getvalue(), err.getvalue()
    assert not out.exists()


def test_a_non_numeric_gguf_epsilon_is_one_line(tmp_path, tokenizer_json):
    gguf_refused(tmp_path, tokenizer_json, "llama", {"llama.attention.layer_norm_rms_epsilon": "tiny"},
                 "inflight import-gguf: GGUF metadata key llama.attention.layer_norm_rms_epsilon is 'tiny', not a number")


# -- cause 15: values accepted silently that changed the model ------------------------------------

@pytest.mark.parametrize("arch,changes,generation,words", [
    ("MistralForCausalLM", {"sliding_window": 0}, None, "config.json: sliding_window is 0; it must be a positive integer"),
    ("MistralForCausalLM", {"sliding_window": 12.5}, None, "config.json: sliding_window is 12.5"),
    ("LlamaForCausalLM", {"tie_word_embeddings": "yes"}, None, "config.json: tie_word_embeddings is 'yes'; it must be true or false"),
    ("LlamaForCausalLM", {}, {"eos_token_id": -1}, "generation_config.json: eos_token_id is -1; it must be a token id"),
    ("LlamaForCausalLM", {}, {"eos_token_id": [2, 10**12]}, "eos_token_id is [2, 1000000000000]; it must be a token id (or a "
                                                             "list of them) in 0..1999, within vocab_size 2000"),
    ("LlamaForCausalLM", {"eos_token_id": 10**12}, {"eos_token_id": None}, "config.json: eos_token_id is 1000000000000"),
])
def test_values_that_changed_the_model_are_refused(tiny, tmp_path, arch, changes, generation, words):
    refused(variant(tiny, tmp_path / "c", generation=generation, architectures=[arch], **changes), words)


@pytest.mark.parametrize("arch,raw,words", [
    ("gemma3", {"gemma3.attention.sliding_window": 4, "gemma3.attention.sliding_window_pattern": ["x", "y"]},
     "gemma3.attention.sliding_window_pattern is ['x', 'y']: one flag (true or false) per layer"),
    ("qwen3moe", {"qwen3moe.expert_count": 2, "qwen3moe.expert_used_count": 1, "qwen3moe.expert_feed_forward_length": 64,
                  "qwen3moe.expert_weights_norm": "yes"},
     "GGUF metadata key qwen3moe.expert_weights_norm is 'yes', not true or false"),
    ("llama", {"llama.rope.freq_base": NAN}, "llama.rope.freq_base is nan; it must be a finite number > 0"),
    ("llama", {"llama.rope.freq_base": -10000.0}, "llama.rope.freq_base is -10000.0; it must be a finite number > 0"),
    ("llama", {"llama.rope.freq_base": 0.0}, "llama.rope.freq_base is 0.0; it must be a finite number > 0"),
    ("llama", {"tokenizer.ggml.eos_token_id": 10**12}, "tokenizer.ggml.eos_token_id is 1000000000000; it must be a token id"),
])
def test_gguf_values_that_changed_the_model_are_refused(tmp_path, tokenizer_json, arch, raw, words):
    gguf_refused(tmp_path, tokenizer_json, arch, raw, words)


def test_valid_edge_values_still_load(tiny, tmp_path):
    """What the rules allow at their edges loads as written."""
    cfg = load_model_config(variant(tiny, tmp_path / "c", rms_norm_eps=0.5, rope_scaling={"rope_type": "linear", "factor": 1},
                                    eos_token_id=[1999], architectures=["MistralForCausalLM"], sliding_window=1,
                                    tie_word_embeddings=True, rope_theta=1, generation={"eos_token_id": None}))
    assert (cfg.rms_norm_eps, cfg.rope_scaling["factor"], cfg.eos_token_ids, cfg.layer_windows, cfg.rope_theta) == \
        (0.5, 1, (1999,), (1, 1), 1.0)
    assert math.isfinite(cfg.attention_scale)


def test_an_unreadable_weights_header_is_one_line(tiny, tmp_path):
    """The counts are read from the headers first, so a broken header is refused there, in one line."""
    path = variant(tiny, tmp_path / "c")
    (path / "model.safetensors").unlink()
    (path / "model.safetensors").write_bytes(b"\xff" * 64)
    refused(path, "model.safetensors is not a readable safetensors file")


@pytest.mark.parametrize("arch,raw,key", [
    ("gemma3", {"gemma3.attention.sliding_window": 4, "gemma3.attention.sliding_window_pattern": ["x", "y"]},
     "gemma3.attention.sliding_window_pattern"),
    ("qwen3moe", {"qwen3moe.expert_count": 2, "qwen3moe.expert_used_count": 1, "qwen3moe.expert_feed_forward_length": 64,
                  "qwen3moe.expert_weights_norm": "yes"}, "qwen3moe.expert_weights_norm"),
])
def test_gguf_strings_are_not_taken_as_true_flags(tmp_path, tokenizer_json, arch, raw, key):
    """The mapping itself refuses them (it once made every layer local, or renormalized the experts'
    weights, from a string's truth), before the tensors are looked at."""
    from backend.models.gguf.importer import _open
    from backend.models.gguf.tensors import numpy_shape as _numpy_shape
    from backend.models.gguf.mapping import hf_config
    path = tmp_path / "x.gguf"
    write_gguf(path, tokenizer_json, arch=arch, types=("F32",), raw_metadata=raw)
    reader, meta = _open(path)
    with pytest.raises(ValueError, match=key):
        hf_config(meta, {t.name: _numpy_shape(t) for t in reader.tensors}, "float32")


def test_sliding_window_is_read_by_the_architectures_transformers_reads_it_for(tmp_path):
    """Llama reads none (it once slid the layers from the 28th on, as Qwen's default does); Mixtral
    slides every layer, as Mistral (it once did so from the 28th on too)."""
    base = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=30, num_attention_heads=4, vocab_size=100,
                sliding_window=4096, num_local_experts=2, num_experts_per_tok=1)
    for arch, windows in (("LlamaForCausalLM", ()), ("MixtralForCausalLM", (4096,) * 30)):
        folder = tmp_path / arch
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(dict(base, architectures=[arch])))
        assert load_model_config(folder).layer_windows == windows, arch
