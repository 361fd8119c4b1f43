"""One validation of a checkpoint's configuration, shared by both ways a model arrives: a Hugging
Face ``config.json`` (backend/models/loader.py) and a GGUF file's metadata once mapped to those keys
(backend/models/gguf/importer.py, which names the GGUF keys instead).

`model_fields` reads every value `ModelConfig` is built from, and each read checks its type (an
integer is an int, a flag a bool), that a number is finite, and its range; the positions a model
claims are capped at `MAX_CONTEXT_LENGTH` (its RoPE table is sized by them). A refusal is one
`CheckpointConfigError` line naming the key, its value and the rule, so `inflight serve` and
`inflight import-gguf` show that line rather than a traceback or a model that computes NaN.
backend/models/weight_shapes.py then holds the counts to the weights before anything is allocated.
Torch-free: it reads plain values.
"""
from __future__ import annotations

import math
import numbers
from typing import Any, Mapping, NoReturn, Optional

MAX_CONTEXT_LENGTH = 1 << 20  # positions: above every published model (Qwen2.5-1M: 1,010,000)
MAX_COUNT = (1 << 31) - 1  # any size, count or window: what an int32 index holds
GATED_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}  # HF name -> the kernel's
ROPE_TYPES = ("default", "linear", "llama3")
GEMMA3_PATTERN = 6  # sliding_window_pattern's default: five local layers, then a global one
MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen3MoeForCausalLM")  # backend/models/moe.py
QWEN_ARCHITECTURES = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
LAYER_TYPES = ("sliding_attention", "full_attention")
_MISSING = object()


class CheckpointConfigError(ValueError):
    """A checkpoint's configuration value inflight refuses: one line naming the key, its value and
    the rule (a ValueError, as every bad configuration is)."""


def shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class Reader:
    """Typed reads of one configuration mapping; `names` spells a key as its file does (a GGUF
    file's own keys), `prefix` places a nested mapping (``rope_scaling.``)."""

    def __init__(self, cfg: Any, where: str = "config.json: ", names: Optional[Mapping[str, str]] = None,
                 prefix: str = ""):
        self.cfg, self.where, self.names, self.prefix = cfg, where, names or {}, prefix

    def name(self, key: str) -> str:
        return self.names.get(self.prefix + key, self.prefix + key)

    def fail(self, key: str, value: Any, rule: str) -> NoReturn:
        raise CheckpointConfigError(f"{self.where}{self.name(key)} is {shown(value)}; it must be {rule}")

    def value(self, key: str, default: Any = _MISSING) -> Any:
        value = self.cfg.get(key, default)
        if value is _MISSING:
            raise CheckpointConfigError(f"{self.where}{self.name(key)} is missing")
        return value

    def integer(self, key: str, default: Any = _MISSING, low: int = 1, high: int = MAX_COUNT,
                optional: bool = False) -> Optional[int]:
        value = self.value(key, default)
        if value is None and optional:
            return None
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not low <= value <= high:
            self.fail(key, value, "a positive integer (at most 2147483647)" if (low, high) == (1, MAX_COUNT)
                      else f"an integer in {low}..{high}")
        return int(value)

    def number(self, key: str, default: Any = _MISSING, low: float = 0.0, high: float = math.inf,
               optional: bool = False, at_least: bool = False) -> Optional[float]:
        """A finite number in (low, high), or [low, high) `at_least`."""
        value = self.value(key, default)
        if value is None and optional:
            return None
        if (isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value)
                or not (low <= value if at_least else low < value) or not value < high):
            self.fail(key, value, f"a finite number {'>=' if at_least else '>'} {low:g}"
                      + (f" and < {high:g}" if high < math.inf else ""))
        return float(value)

    def flag(self, key: str, default: bool = False) -> bool:
        value = self.value(key, default)
        if not isinstance(value, bool):
            self.fail(key, value, "true or false")
        return value

    def text(self, key: str, default: Any, allowed: tuple[str, ...]) -> str:
        value = self.value(key, default)
        if not isinstance(value, str) or value not in allowed:
            self.fail(key, value, "one of " + ", ".join(allowed))
        return value

    def rope_type(self) -> str:
        """A rope's type (``rope_type``, or the older ``type``; default when neither is set)."""
        key = "rope_type" if self.cfg.get("rope_type") is not None else "type"
        return self.text(key, self.cfg.get(key) or "default", ROPE_TYPES)

    def mapping(self, key: str) -> Optional["Reader"]:
        """The nested mapping at `key` as a Reader, or None when absent or null."""
        value = self.cfg.get(key)
        if value is None:
            return None
        if not isinstance(value, dict):
            self.fail(key, value, "a JSON object")
        return Reader(value, self.where, self.names, f"{self.prefix}{key}.")

    def token_ids(self, key: str, value: Any, vocab: int) -> tuple[int, ...]:
        """`value` (read at `key`): null, a token id or a list of them, each within the vocabulary."""
        ids = value if isinstance(value, list) else [] if value is None else [value]
        for i in ids:
            if isinstance(i, bool) or not isinstance(i, numbers.Integral) or not 0 <= i < vocab:
                self.fail(key, value, f"a token id (or a list of them) in 0..{vocab - 1}, within vocab_size {vocab}")
        return tuple(int(i) for i in ids)


def rope(cfg: Reader, key: Optional[str], theta: Any, scaling_key: Optional[str]) -> tuple[float, Optional[dict]]:
    """(theta, scaling or None for the default rope), checked, from HF's newer `rope_parameters`
    (one layer kind's: `key`) or its older `rope_theta` + `rope_scaling` (`scaling_key`)."""
    params = cfg.mapping(key) if key else None
    scaling = cfg.mapping(scaling_key) if scaling_key else None
    where = cfg
    if params is not None:
        where = params
        if params.rope_type() != "default":
            scaling = params
    if where.cfg.get("rope_theta") is None:  # absent or null: the architecture's default (0 is refused)
        where = Reader({"rope_theta": 10000.0 if theta is None else theta}, cfg.where, cfg.names, where.prefix)
    theta = where.number("rope_theta")
    kind = scaling.rope_type() if scaling is not None else "default"
    if kind == "default":
        return theta, None
    scaling.number("factor", low=1.0, at_least=True)  # transformers' rule: a factor >= 1
    if kind == "llama3":
        low = scaling.number("low_freq_factor")
        scaling.number("high_freq_factor", low=low)
        scaling.integer("original_max_position_embeddings", high=MAX_CONTEXT_LENGTH)
    return theta, scaling.cfg


def layer_windows(cfg: Reader, arch: str, layers: int) -> tuple[int, ...]:
    """Each layer's sliding window (0: global), as transformers decides it for `arch`."""
    if arch == "LlamaForCausalLM" or arch in QWEN_ARCHITECTURES and not cfg.flag("use_sliding_window", False):
        return ()  # (transformers' Llama reads no sliding_window)
    window = cfg.integer("sliding_window", None, optional=True)
    if window is None:
        return ()
    types = cfg.value("layer_types", None)
    if arch in ("MistralForCausalLM", "MixtralForCausalLM"):  # every layer slides (HF's read no layer_types)
        types = ["sliding_attention"] * layers
    elif types is None and arch.startswith("Gemma3"):
        pattern = cfg.integer("sliding_window_pattern", GEMMA3_PATTERN)
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    elif types is None:  # Qwen2/3: the layers from max_window_layers on
        first = cfg.integer("max_window_layers", 28, low=0)
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    if not isinstance(types, list) or len(types) != layers or any(t not in LAYER_TYPES for t in types):
        cfg.fail("layer_types", types, f"a list of 'sliding_attention' or 'full_attention' for each of the {layers} layers")
    windows = tuple(window if t == "sliding_attention" else 0 for t in types)
    return windows if any(windows) else ()


def model_fields(cfg: Mapping[str, Any], arch: str, top: Optional[Mapping[str, Any]] = None,
                 gen: Optional[Mapping[str, Any]] = None, where: str = "config.json: ",
                 names: Optional[Mapping[str, str]] = None) -> dict[str, Any]:
    """`ModelConfig`'s fields read from `cfg` (the text model's config, defaults filled in), every one
    checked. `top`: the file's outer config (a multimodal one's), `gen`: generation_config.json."""
    r, top_r = Reader(cfg, where, names), Reader(top if top is not None else cfg, where, names)
    gen = gen or {}
    gemma = arch.startswith("Gemma3")
    hidden, heads, layers = r.integer("hidden_size"), r.integer("num_attention_heads"), r.integer("num_hidden_layers")
    kv_heads = r.integer("num_key_value_heads", None, optional=True) or heads
    if heads % kv_heads:
        r.fail("num_key_value_heads", kv_heads, f"a divisor of {r.name('num_attention_heads')} {heads}")
    head_dim = r.integer("head_dim", None, optional=True)
    if head_dim is None and hidden % heads:
        r.fail("num_attention_heads", heads, f"a divisor of {r.name('hidden_size')} {hidden} (no head_dim is given)")
    head_dim = head_dim or hidden // heads
    if head_dim % 2:
        r.fail("head_dim", head_dim, "even (rotary embeddings rotate pairs)")
    vocab = r.integer("vocab_size")
    eos, bos = (_token_ids(key, vocab, gen, r, top_r) for key in ("eos_token_id", "bos_token_id"))
    act_key = "hidden_activation" if cfg.get("hidden_activation") else "hidden_act"
    activation = r.text(act_key, cfg.get(act_key) or "silu", tuple(GATED_ACTIVATIONS))
    rope_params = cfg.get("rope_parameters")
    if gemma and isinstance(rope_params, dict) and "full_attention" in rope_params:  # one set per layer kind
        kinds = r.mapping("rope_parameters")
        rope_theta, rope_scaling = rope(kinds, "full_attention", 1_000_000.0, None)
        local_theta, local_scaling = rope(kinds, "sliding_attention", 10_000.0, None)
    else:
        rope_theta, rope_scaling = rope(r, "rope_parameters", r.value("rope_theta", 1_000_000.0 if gemma else None),
                                        "rope_scaling")
        local_theta, local_scaling = r.number("rope_local_base_freq", 10_000.0), None
    tied = top_r.flag("tie_word_embeddings", r.flag("tie_word_embeddings", False))
    return dict(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=r.integer("intermediate_size"), num_layers=layers,
        num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
        rms_norm_eps=r.number("rms_norm_eps", 1e-6, high=1.0),
        rope_theta=rope_theta, rope_scaling=rope_scaling,
        max_position_embeddings=r.integer("max_position_embeddings", 2048, high=MAX_CONTEXT_LENGTH),
        tie_word_embeddings=tied, attention_bias=r.flag("attention_bias", False), mlp_bias=r.flag("mlp_bias", False),
        eos_token_ids=eos, bos_token_id=bos[0] if bos else None,
        layer_windows=layer_windows(r, arch, layers),
        local_rope_theta=local_theta if gemma else None, local_rope_scaling=local_scaling if gemma else None,
        activation=GATED_ACTIVATIONS[activation],
        query_pre_attn_scalar=r.number("query_pre_attn_scalar") if gemma else None,
        # transformers caps the logits in Gemma3ForCausalLM only: its multimodal class ignores the
        # text config's cap (real Gemma 3 checkpoints set none)
        final_logit_softcapping=(r.number("final_logit_softcapping", None, optional=True)
                                 if arch == "Gemma3ForCausalLM" else None),
        **moe_fields(r, arch, layers))


def _token_ids(key: str, vocab: int, gen: Mapping[str, Any], *readers: Reader) -> tuple[int, ...]:
    """`key`'s token ids from generation_config.json first, else the text config, else the outer one."""
    source = next((c for c in (gen, readers[0].cfg, readers[1].cfg) if key in c), {})
    reader = Reader(source, "generation_config.json: " if source is gen else readers[0].where, readers[0].names)
    return reader.token_ids(key, source.get(key), vocab)


def moe_fields(r: Reader, arch: str, layers: int) -> dict[str, Any]:
    """The mixture-of-experts fields (none for a dense architecture), checked."""
    if arch not in MOE_ARCHITECTURES:
        return {}
    mixtral = arch == "MixtralForCausalLM"
    experts_key = "num_local_experts" if mixtral or not r.cfg.get("num_experts") else "num_experts"
    experts = r.integer(experts_key, None)
    used = r.integer("num_experts_per_tok", None)
    if used > experts:
        r.fail("num_experts_per_tok", used, f"at most {r.name(experts_key)} {experts}")
    dense = () if mixtral else r.value("mlp_only_layers", None) or ()
    if not isinstance(dense, list | tuple) or any(
            isinstance(i, bool) or not isinstance(i, numbers.Integral) or not 0 <= i < layers for i in dense):
        r.fail("mlp_only_layers", dense, f"a list of layer numbers in 0..{layers - 1}")
    return dict(num_experts=experts, num_experts_per_tok=used,
                moe_intermediate_size=r.integer("intermediate_size" if mixtral else "moe_intermediate_size", None),
                norm_topk_prob=True if mixtral else r.flag("norm_topk_prob", False),
                decoder_sparse_step=1 if mixtral else r.integer("decoder_sparse_step", 1),
                mlp_only_layers=tuple(int(i) for i in dense))
