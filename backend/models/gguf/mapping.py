"""What a GGUF file's metadata and tensor names mean in Hugging Face terms (for backend/models/gguf/importer.py).

- ``general.architecture`` llama / mistral / qwen2 / qwen3 / gemma3 -> LlamaForCausalLM /
  MistralForCausalLM / Qwen2ForCausalLM / Qwen3ForCausalLM / Gemma3ForCausalLM (qwen2vl, Qwen2.5-VL's
  text model, -> Qwen2ForCausalLM: with its mmproj, mmproj_qwen.py makes it the vision model) (Mistral files
  usually say "llama"; as in transformers, a ``general.name`` containing "mistral" makes them
  Mistral); anything else is refused by name.
- ``<arch>.*`` keys -> ``config.json``; no ``output.weight`` -> tied embeddings.
- ``blk.N.attn_q.weight``... -> ``model.layers.N.self_attn.q_proj.weight``...; ``attn_q_norm`` /
  ``attn_k_norm`` (Qwen3, Gemma 3) -> ``self_attn.q_norm`` / ``k_norm``. Gemma 3 names its four
  norms per layer apart: ``attn_norm``, ``post_attention_norm``, ``ffn_norm`` (the MLP's input: HF's
  pre_feedforward_layernorm, where Llama's ``ffn_norm`` is HF's post_attention_layernorm) and
  ``post_ffw_norm``.
- llama.cpp's converter permutes the rows of q_proj and k_proj of Llama-architecture models (its
  rope rotates interleaved pairs, HF's the two halves of each head): ``unpermute_rows`` inverts it.
  Qwen2, Qwen3 and Gemma 3 files keep HF's order (llama.cpp runs their rope in NeoX mode).
- Gemma 3: the converter stores every RMSNorm weight as 1 + w (Gemma's norm multiplies by 1 + w;
  ggml's by w): `GEMMA_NORM_SHIFT` is taken off again, so the folder holds HF's w. llama.cpp reads
  no sliding-window pattern, local RoPE base or query_pre_attn_scalar for gemma3: it takes 6
  (five local layers, then a global one), 10,000, and head_dim (hidden / heads for the 62-layer
  27B); the importer does the same, but reads ``<arch>.attention.sliding_window_pattern`` (a period
  or one flag per layer) and ``<arch>.rope.freq_base_swa`` where a file has them. Linear rope
  scaling applies to the global layers only, as in llama.cpp and transformers.
- ``rope_freqs.weight`` (Llama 3.1+: per-frequency rope divisors) -> ``rope_scaling`` llama3.
- Mixtures of experts: a ``llama`` file with ``llama.expert_count`` is Mixtral, ``qwen3moe`` is
  Qwen3-MoE. llama.cpp stacks each layer's experts: ``ffn_gate_exps`` / ``ffn_up_exps`` /
  ``ffn_down_exps`` [E, N, K] and the router ``ffn_gate_inp`` [E, H]. They keep HF's module names
  without the expert index (``block_sparse_moe.experts.w1`` for Mixtral, ``mlp.experts.gate_proj``
  for Qwen3-MoE); the importer writes packed ones stacked and float ones per expert
  (``experts.{e}.w1.weight``: a plain HF checkpoint). A Qwen3-MoE layer without ``ffn_gate_inp``
  is dense (``mlp_only_layers``); llama.cpp always renormalizes qwen3moe's top-k weights unless
  ``qwen3moe.expert_weights_norm`` says otherwise, so ``norm_topk_prob`` follows that key.
"""
from __future__ import annotations

import numbers
import re
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from backend.models.checkpoint_config import CheckpointConfigError, shown

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen2vl", "qwen3", "gemma3", "qwen3moe")
HF_CLASSES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
              "qwen2vl": "Qwen2ForCausalLM",  # Qwen2.5-VL's text model: its M-RoPE is 1-D rope on text (mmproj_qwen.py)
              "qwen3": "Qwen3ForCausalLM", "gemma3": "Gemma3ForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM"}
MODEL_TYPES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
               "Qwen3ForCausalLM": "qwen3", "Gemma3ForCausalLM": "gemma3_text", "MixtralForCausalLM": "mixtral",
               "Qwen3MoeForCausalLM": "qwen3_moe"}
PERMUTED_ARCHITECTURES = ("llama", "mistral")  # q/k rows permuted by llama.cpp's converter
GEMMA_NORM_SHIFT = 1.0  # what llama.cpp's converter adds to every Gemma 3 norm weight
GEMMA3_PATTERN = 6  # llama.cpp's gemma3: five local layers, then a global one
GEMMA3_LOCAL_ROPE_BASE = 10_000.0

# GGUF tensor name (after blk.N.) -> HF name (after model.layers.N.)
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_QK_NORMS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_ARCH_LAYER_TENSORS = {
    "qwen3": {**_LAYER_TENSORS, **_QK_NORMS},
    "qwen3moe": {**_LAYER_TENSORS, **_QK_NORMS},
    "gemma3": {**_LAYER_TENSORS, **_QK_NORMS, "post_attention_norm": "post_attention_layernorm",
               "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm"},
}
_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                   "output": "lm_head"}
# mixture-of-experts layers: the router and the stacked experts' gate, up, down, by GGUF architecture
# (a llama file with experts is Mixtral)
MOE_TENSORS = ("ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
_MOE_NAMES = {"llama": ("block_sparse_moe", ("gate", "experts.w1", "experts.w3", "experts.w2")),
              "qwen3moe": ("mlp", ("gate", "experts.gate_proj", "experts.up_proj", "experts.down_proj"))}
# Llama 3.1+ files store their rope scaling as per-frequency factors; HF configs as parameters.
ROPE_FREQS = "rope_freqs.weight"
_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


class GGUFImportError(CheckpointConfigError):
    """A GGUF file this importer cannot convert (the message says what and why)."""


def float32_decimal(value: float) -> float:
    """A float hyperparameter as config.json gets it: a value float32 holds exactly (GGUF stores its
    floats as float32) is written as the shortest decimal that reads back as the same float32, the
    value the checkpoint had (1e-05, not 9.999999747378752e-06); any other (a float64 key) as it is."""
    value = float(value)
    with np.errstate(over="ignore"):
        single = np.float32(value)
    return float(str(single)) if float(single) == value else value


def read_metadata(reader) -> dict[str, Any]:
    """Every key-value field of a ``gguf.GGUFReader`` as plain Python values."""
    return {name: field.contents() for name, field in reader.fields.items()
            if not name.startswith("GGUF.")}


def hf_architecture(meta: dict[str, Any]) -> tuple[str, str]:
    """(GGUF architecture, HF architecture class) of a file; refuses unsupported ones."""
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise GGUFImportError(f"GGUF architecture {arch!r} is not supported; supported: "
                              f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    name = str(meta.get("general.name") or "").lower()
    if arch == "llama" and meta.get("llama.expert_count"):
        return arch, "MixtralForCausalLM"
    if arch == "llama" and "mistral" in name:
        return arch, "MistralForCausalLM"
    return arch, HF_CLASSES[arch]


def hf_config(meta: dict[str, Any], tensor_shapes: Mapping[str, Sequence[int]],
              out_dtype: str) -> dict[str, Any]:
    """``config.json`` from the file's ``<arch>.*`` keys and its tensors (name -> numpy shape)."""
    arch, architecture = hf_architecture(meta)

    def key(name: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{name}", default)
        if value is None:
            raise GGUFImportError(f"GGUF metadata key {arch}.{name} is missing")
        return value

    def integer(name: str, default: Any = None) -> int:
        value = key(name, default)
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise GGUFImportError(f"GGUF metadata key {arch}.{name} is {shown(value)}, not an integer")
        return int(value)

    def number(name: str, default: Any = None) -> float:  # its range: checks.py, after the mapping
        value = key(name, default)
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise GGUFImportError(f"GGUF metadata key {arch}.{name} is {shown(value)}, not a number")
        return float32_decimal(value)

    hidden, heads = integer("embedding_length"), integer("attention.head_count")
    head_dim = next((integer(k) for k in ("attention.key_length", "rope.dimension_count")
                     if meta.get(f"{arch}.{k}") is not None), None)
    tokens = meta.get("tokenizer.ggml.tokens")
    embedding = tensor_shapes.get("token_embd.weight")
    vocab = (integer("vocab_size") if meta.get(f"{arch}.vocab_size") is not None else
             len(tokens) if isinstance(tokens, list) and tokens else embedding[0] if embedding else None)
    config: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": MODEL_TYPES[architecture],
        "hidden_size": hidden,
        "intermediate_size": integer("feed_forward_length"),
        "num_hidden_layers": integer("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": integer("attention.head_count_kv", heads),
        # head_count 0 is refused by backend/models/gguf/checks.py, which reads this config
        "head_dim": int(head_dim or (hidden // heads if heads > 0 else 0)),
        "rms_norm_eps": number("attention.layer_norm_rms_epsilon"),
        "rope_theta": number("rope.freq_base", 10000.0),
        "max_position_embeddings": integer("context_length", 4096),
        "vocab_size": int(vocab) if vocab else None,  # none: refused by checks.py, naming it
        "tie_word_embeddings": "output.weight" not in tensor_shapes,
        "hidden_act": "silu",
        "torch_dtype": out_dtype,
    }
    if architecture in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM"):
        config["use_sliding_window"] = False
    elif architecture in ("MistralForCausalLM", "MixtralForCausalLM"):
        config["sliding_window"] = None  # the file states none; HF's class default would add one
    elif architecture == "LlamaForCausalLM":
        config["attention_bias"] = any(n.endswith("attn_q.bias") for n in tensor_shapes)
    scaling = meta.get(f"{arch}.rope.scaling.type")
    if scaling == "linear":
        config["rope_scaling"] = {"rope_type": "linear", "factor": number("rope.scaling.factor")}
    elif scaling not in (None, "none"):
        raise GGUFImportError(f"{arch}.rope.scaling.type {scaling!r} is not supported; supported: "
                              "none, linear (and Llama 3 scaling stored as rope_freqs)")
    if arch == "gemma3":
        _gemma3_config(config, meta, integer, number)
    if architecture in ("MixtralForCausalLM", "Qwen3MoeForCausalLM"):
        norm = meta.get(f"{arch}.expert_weights_norm")
        if norm is not None and not isinstance(norm, bool):
            raise GGUFImportError(f"GGUF metadata key {arch}.expert_weights_norm is {shown(norm)}, not true or false")
        config.update(_moe_config(architecture, integer, norm, tensor_shapes, config["num_hidden_layers"]))
    for name, key_ in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                       ("pad_token_id", "padding_token_id")):
        value = meta.get(f"tokenizer.ggml.{key_}")
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise GGUFImportError(f"GGUF metadata key tokenizer.ggml.{key_} is {shown(value)}, not an integer")
            config[name] = int(value)  # within the vocabulary: checks.py
    return config


def _gemma3_config(config: dict[str, Any], meta: dict[str, Any], integer, number) -> None:
    """Gemma 3's own config.json keys, as llama.cpp runs a gemma3 file (the module's docstring)."""
    layers, heads = config["num_hidden_layers"], config["num_attention_heads"]
    if meta.get("gemma3.attn_logit_softcapping") is not None:
        raise GGUFImportError("gemma3.attn_logit_softcapping is set; Gemma 3 caps no attention scores "
                              "and inflight's kernels do not")
    pattern = meta.get("gemma3.attention.sliding_window_pattern", GEMMA3_PATTERN)
    if isinstance(pattern, (list, tuple)):  # one flag per layer: true for a local layer
        if len(pattern) != layers:
            raise GGUFImportError(f"gemma3.attention.sliding_window_pattern has {len(pattern)} flags for "
                                  f"{layers} layers")
        if not all(isinstance(p, bool) for p in pattern):
            raise GGUFImportError(f"gemma3.attention.sliding_window_pattern is {shown(pattern)}: one flag "
                                  "(true or false) per layer, or a positive period")
        local = list(pattern)
    elif isinstance(pattern, (int, np.integer)) and not isinstance(pattern, bool) and pattern > 0:
        local = [(i + 1) % int(pattern) != 0 for i in range(layers)]
    else:
        raise GGUFImportError(f"gemma3.attention.sliding_window_pattern is {pattern!r}: a positive "
                              "period or one flag per layer")
    global_rope = {"rope_type": "default", "rope_theta": config.pop("rope_theta")}
    global_rope.update(config.pop("rope_scaling", {}))
    local_base = number("rope.freq_base_swa", GEMMA3_LOCAL_ROPE_BASE)
    config.update({
        "layer_types": ["sliding_attention" if s else "full_attention" for s in local],
        "sliding_window": integer("attention.sliding_window"),
        "rope_parameters": {"full_attention": global_rope,
                            "sliding_attention": {"rope_type": "default", "rope_theta": local_base}},
        # llama.cpp's attention scale: 1 / sqrt(hidden / heads) for the 27B (62 layers), else head_dim's
        "query_pre_attn_scalar": config["hidden_size"] // heads if layers == 62 and heads > 0 else config["head_dim"],
        "final_logit_softcapping": (number("final_logit_softcapping")
                                    if meta.get("gemma3.final_logit_softcapping") is not None else None),
        "hidden_activation": "gelu_pytorch_tanh",
    })
    del config["hidden_act"]


def _moe_config(architecture: str, integer, weights_norm, tensor_shapes, layers: int) -> dict[str, Any]:
    """config.json's expert keys for a Mixtral or Qwen3-MoE file."""
    experts, used = integer("expert_count"), integer("expert_used_count")
    if architecture == "MixtralForCausalLM":
        return {"num_local_experts": experts, "num_experts_per_tok": used}
    # (a block count beyond the file's tensors is refused by checks.py: no longer list than they are)
    dense = [i for i in range(min(layers, len(tensor_shapes))) if f"blk.{i}.ffn_gate_inp.weight" not in tensor_shapes]
    return {"num_experts": experts, "num_experts_per_tok": used, "decoder_sparse_step": 1, "mlp_only_layers": dense,
            "moe_intermediate_size": integer("expert_feed_forward_length"),
            "norm_topk_prob": True if weights_norm is None else bool(weights_norm), "attention_bias": False}


def moe_layer_shapes(config: Mapping[str, Any], layer: int) -> Optional[dict[str, tuple[int, ...]]]:
    """The GGUF tensors of `layer`'s MLP (with their numpy shapes) when it has experts, else None."""
    experts = config.get("num_local_experts") or config.get("num_experts")
    if not experts or layer in config.get("mlp_only_layers", ()):
        return None
    hidden = config["hidden_size"]
    inter = config.get("moe_intermediate_size") or config["intermediate_size"]
    b = f"blk.{layer}."
    return {b + "ffn_gate_inp.weight": (experts, hidden), b + "ffn_gate_exps.weight": (experts, inter, hidden),
            b + "ffn_up_exps.weight": (experts, inter, hidden), b + "ffn_down_exps.weight": (experts, hidden, inter)}


def hf_tensor_name(name: str, arch: str = "llama") -> str:
    """HF parameter name of a GGUF tensor name in a file of `arch`; refuses names it does not know."""
    base, _, suffix = name.rpartition(".")
    if base in _GLOBAL_TENSORS and suffix == "weight":
        return f"{_GLOBAL_TENSORS[base]}.weight"
    match = _LAYER_RE.match(name)
    layer_tensors = _ARCH_LAYER_TENSORS.get(arch, _LAYER_TENSORS)
    if match and match.group(2) in layer_tensors:
        layer, part, suffix = match.groups()
        return f"model.layers.{layer}.{layer_tensors[part]}.{suffix}"
    if match and match.group(2) in MOE_TENSORS and arch in _MOE_NAMES and match.group(3) == "weight":
        block, names = _MOE_NAMES[arch]   # stacked experts: named without the expert index
        return f"model.layers.{match.group(1)}.{block}.{names[MOE_TENSORS.index(match.group(2))]}.weight"
    raise GGUFImportError(f"GGUF tensor {name!r} has no counterpart in the {arch} architecture")


def unpermute_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Invert llama.cpp's q/k permutation: per head, rows (pair, 2) back to (2, half)."""
    rows = weight.shape[0]
    half = rows // num_heads // 2
    return (weight.reshape(num_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2)
            .reshape(weight.shape))


def llama3_factors(head_dim: int, theta: float, factor: float, low: float = 1.0, high: float = 4.0,
                   original: int = 8192) -> np.ndarray:
    """The per-frequency rope divisors that llama.cpp's converter writes for Llama 3 scaling."""
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * np.pi / freqs
    smooth = (original / wavelen - low) / (high - low)
    mid = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < original / high, 1.0, np.where(wavelen > original / low, factor, mid))


def llama3_rope_scaling(factors: np.ndarray, config: dict[str, Any]) -> dict[str, Any]:
    """The HF ``rope_scaling`` that reproduces a file's ``rope_freqs``: llama3 with Meta's
    defaults (low 1, high 4, original context 8192) and the file's largest factor; anything else
    is refused rather than imported with positions that differ from the original model."""
    factor = float32_decimal(factors.max())  # the file's factors are float32
    expected = llama3_factors(config["head_dim"], config["rope_theta"], factor)
    if factors.shape != expected.shape or not np.allclose(factors, expected, rtol=1e-4):
        raise GGUFImportError(f"{ROPE_FREQS} is not Llama 3 rope scaling (factor {factor:g}, "
                              "low_freq_factor 1, high_freq_factor 4, original context 8192); "
                              "other rope scalings are not supported")
    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}
