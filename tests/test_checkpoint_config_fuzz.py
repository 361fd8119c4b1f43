"""Hypothesis over every key the two loaders read (issue 46): a config.json beside a real tiny
checkpoint's weights, and a real tiny GGUF file's metadata, each with one to three values replaced
by hostile ones (wrong types, NaN, infinities, negatives, huge numbers, nested junk). Whatever comes
in, the result is either a ValueError of one line that names one of the replaced keys, or a
configuration a model can be built from: finite, in range, its RoPE tables finite. Never another
exception, never a hang (each example has a deadline). Bounded: a few seconds in all.
"""
import json
import math

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from backend.models.checkpoint_config import MAX_CONTEXT_LENGTH, CheckpointConfigError, model_fields
from backend.models.gguf.checks import check_config, check_shapes, gguf_names
from backend.models.gguf.importer import _open
from backend.models.gguf.tensors import numpy_shape as _numpy_shape
from backend.models.gguf.mapping import hf_architecture, hf_config
from backend.models.loader import load_model_config
from backend.models.make_model import make_model
from backend.models.rope import rope_cos_sin
from gguf_files import write_gguf

FUZZ = settings(max_examples=120, deadline=2000, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

NUMBERS = st.one_of(st.integers(-2**70, 2**70), st.sampled_from([0, 1, -1, 2, 3, 2**31, 2**40, 0.5, 12.5]),
                    st.floats(allow_nan=True, allow_infinity=True))
SCALARS = st.one_of(st.none(), st.booleans(), NUMBERS, st.text(max_size=6), st.sampled_from(["linear", "llama3", "yes"]))
ROPE_DICTS = st.dictionaries(
    st.sampled_from(["rope_type", "type", "factor", "rope_theta", "low_freq_factor", "high_freq_factor",
                     "original_max_position_embeddings", "full_attention", "sliding_attention"]),
    st.one_of(SCALARS, st.sampled_from(["linear", "llama3", "default", "yarn"]),
              st.fixed_dictionaries({"rope_type": st.sampled_from(["linear", "default"]), "factor": NUMBERS})),
    max_size=4)
HOSTILE = st.one_of(SCALARS, st.lists(st.one_of(st.integers(-3, 2100), st.text(max_size=3), st.booleans(),
                                                st.sampled_from(["sliding_attention", "full_attention"])), max_size=4),
                    ROPE_DICTS)

ARCHITECTURES = {  # base config.json keys over the tiny Llama's, per architecture
    "LlamaForCausalLM": {}, "MistralForCausalLM": {"sliding_window": 64},
    "Qwen2ForCausalLM": {"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 1},
    "Qwen3ForCausalLM": {}, "Gemma3ForCausalLM": {"sliding_window_pattern": 2, "sliding_window": 32},
    "Gemma3ForConditionalGeneration": {"text_config": "the tiny Llama's config"},
    "MixtralForCausalLM": {"num_local_experts": 2, "num_experts_per_tok": 1},
    "Qwen3MoeForCausalLM": {"num_experts": 2, "num_experts_per_tok": 1, "moe_intermediate_size": 64,
                            "mlp_only_layers": [1], "norm_topk_prob": True, "decoder_sparse_step": 1},
}
CONFIG_KEYS = sorted({
    "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "vocab_size", "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters", "max_position_embeddings",
    "tie_word_embeddings", "attention_bias", "mlp_bias", "eos_token_id", "bos_token_id", "hidden_act",
    "hidden_activation", "torch_dtype", "dtype", "quantization_config", "architectures", "sliding_window",
    "use_sliding_window", "max_window_layers", "layer_types", "sliding_window_pattern", "query_pre_attn_scalar",
    "final_logit_softcapping", "rope_local_base_freq", "attn_logit_softcapping", "use_bidirectional_attention",
    "text_config", "num_local_experts", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
    "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers"})


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("tiny"), num_hidden_layers=2)


def assert_buildable(cfg, layers_held: int = 2) -> None:
    """What a model is built from: counts positive and backed, numbers finite, RoPE tables finite."""
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim"):
        value = getattr(cfg, name)
        assert isinstance(value, int) and not isinstance(value, bool) and value >= 1, (name, value)
    assert cfg.num_layers <= layers_held and cfg.num_heads % cfg.num_kv_heads == 0 and cfg.head_dim % 2 == 0
    assert 0 < cfg.rms_norm_eps < 1 and 1 <= cfg.max_position_embeddings <= MAX_CONTEXT_LENGTH
    assert all(isinstance(getattr(cfg, f), bool) for f in ("tie_word_embeddings", "qkv_bias", "mlp_bias", "norm_topk_prob"))
    assert all(isinstance(t, int) and 0 <= t < cfg.vocab_size for t in cfg.eos_token_ids)
    assert cfg.bos_token_id is None or 0 <= cfg.bos_token_id < cfg.vocab_size
    assert not cfg.layer_windows or (len(cfg.layer_windows) == cfg.num_layers and all(
        isinstance(w, int) and w >= 0 for w in cfg.layer_windows))
    assert math.isfinite(cfg.attention_scale) and cfg.attention_scale > 0
    assert cfg.final_logit_softcapping is None or (math.isfinite(cfg.final_logit_softcapping) and cfg.final_logit_softcapping > 0)
    for theta, scaling in ((cfg.rope_theta, cfg.rope_scaling), (cfg.local_rope_theta, cfg.local_rope_scaling)):
        if theta is not None:
            cos, sin = rope_cos_sin(cfg.head_dim, 64, theta, scaling)
            assert torch.isfinite(cos).all() and torch.isfinite(sin).all()
    if cfg.num_experts:
        assert 1 <= cfg.num_experts_per_tok <= cfg.num_experts and cfg.moe_intermediate_size >= 1
        assert all(0 <= i < cfg.num_layers for i in cfg.mlp_only_layers)


def assert_names_one(message: str, keys) -> None:
    assert "\n" not in message, message
    assert any(k in message for k in keys), (keys, message)


@FUZZ
@given(arch=st.sampled_from(sorted(ARCHITECTURES)),
       changes=st.dictionaries(st.sampled_from(CONFIG_KEYS), HOSTILE, min_size=1, max_size=3),
       generation=st.dictionaries(st.sampled_from(["eos_token_id", "bos_token_id"]), HOSTILE, max_size=1))
def test_config_json_values_are_refused_by_name_or_load_valid(tiny, tmp_path_factory, arch, changes, generation):
    folder = tmp_path_factory.mktemp("fuzz", numbered=True)
    for f in tiny.iterdir():
        if f.name not in ("config.json", "generation_config.json"):
            (folder / f.name).symlink_to(f)
    base = json.loads((tiny / "config.json").read_text())
    cfg = {**base, "architectures": [arch], **ARCHITECTURES[arch], **changes}
    if cfg.get("text_config") == "the tiny Llama's config":  # a multimodal Gemma 3: the text model inside
        cfg["text_config"] = base
    gen = {**json.loads((tiny / "generation_config.json").read_text()), **generation}
    (folder / "config.json").write_text(json.dumps(cfg))
    (folder / "generation_config.json").write_text(json.dumps(gen))
    try:
        model_cfg = load_model_config(folder)
    except ValueError as exc:
        assert_names_one(str(exc), list(changes) + list(generation))
        event("refused")
    else:
        assert_buildable(model_cfg)
        event("loaded")  # (--hypothesis-show-statistics: how often each)


GGUF_KEYS = ["embedding_length", "attention.head_count", "attention.head_count_kv", "attention.key_length",
             "rope.dimension_count", "vocab_size", "feed_forward_length", "block_count",
             "attention.layer_norm_rms_epsilon", "rope.freq_base", "context_length", "rope.scaling.type",
             "rope.scaling.factor", "expert_count", "expert_used_count", "expert_feed_forward_length",
             "expert_weights_norm", "attention.sliding_window", "attention.sliding_window_pattern",
             "rope.freq_base_swa", "final_logit_softcapping", "attn_logit_softcapping"]
OTHER_GGUF_KEYS = ["general.architecture", "general.name", "tokenizer.ggml.tokens", "tokenizer.ggml.bos_token_id",
                   "tokenizer.ggml.eos_token_id", "tokenizer.ggml.padding_token_id"]
GGUF_BASES = {"llama": {}, "gemma3": {"attention.sliding_window": 4},
              "qwen3moe": {"expert_count": 2, "expert_used_count": 1, "expert_feed_forward_length": 64}}


@pytest.fixture(scope="module", params=sorted(GGUF_BASES))
def gguf_file(request, tiny, tmp_path_factory):
    """(metadata, tensor shapes) of a real tiny GGUF file of one architecture, as the importer reads them."""
    arch = request.param
    path = tmp_path_factory.mktemp("gguf") / f"{arch}.gguf"
    write_gguf(path, tiny / "tokenizer.json", arch=arch, types=("F32",),
               raw_metadata={f"{arch}.{k}": v for k, v in GGUF_BASES[arch].items()})
    reader, meta = _open(path)
    return meta, {t.name: _numpy_shape(t) for t in reader.tensors}


@FUZZ
@given(data=st.data())
def test_gguf_metadata_is_refused_by_name_or_maps_to_a_valid_config(gguf_file, data):
    meta, shapes = gguf_file
    arch = meta["general.architecture"]
    keys = [f"{arch}.{k}" for k in GGUF_KEYS] + OTHER_GGUF_KEYS
    changes = data.draw(st.dictionaries(st.sampled_from(keys), HOSTILE, min_size=1, max_size=3))
    meta = {**meta, **changes}
    try:
        gguf_arch, _ = hf_architecture(meta)
        config = hf_config(meta, shapes, "float32")
        check_config(config, gguf_arch, head_dim_given=meta.get(f"{gguf_arch}.attention.key_length") is not None)
        check_shapes(shapes, config, gguf_arch)
    except CheckpointConfigError as exc:
        message = str(exc)
        # a count the tensors contradict is named by the tensor whose shape it sets; a key the
        # changed ones call for (expert_count makes a Mixtral) by its name
        assert_names_one(message, list(changes) + ["GGUF architecture", "tensor", "the vocabulary size", "is missing"])
        event("refused")
    else:
        event("mapped")
        fields = model_fields(config, config["architectures"][0], where="", names=gguf_names(gguf_arch))
        assert 0 < fields["rms_norm_eps"] < 1 and math.isfinite(fields["rope_theta"])


TOKENIZER_KEYS = ["tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.scores", "tokenizer.ggml.token_type",
                  "tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
                  "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.padding_token_id", "tokenizer.ggml.add_bos_token",
                  "tokenizer.ggml.add_space_prefix", "tokenizer.chat_template"]


@settings(FUZZ, max_examples=60)
@given(data=st.data())
def test_gguf_tokenizer_metadata_is_refused_by_name_or_builds(gguf_file, data):
    """The importer's tokenizer keys: a ValueError naming one (the import then writes no tokenizer
    and says why), or a tokenizer that encodes."""
    from backend.models.gguf.tokenizer import build_tokenizer, tokenizer_config
    meta, _ = gguf_file
    if meta["general.architecture"] != "llama":
        return  # the keys are the same in every file
    changes = data.draw(st.dictionaries(st.sampled_from(TOKENIZER_KEYS), HOSTILE, min_size=1, max_size=2))
    meta = {**meta, **changes}
    try:
        tokenizer, _ = build_tokenizer(meta), tokenizer_config(meta)
    except ValueError as exc:
        assert_names_one(str(exc), list(changes))
        event("refused")
    else:
        assert isinstance(tokenizer.encode("hello world").ids, list)
        event("built")
