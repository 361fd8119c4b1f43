"""Read a Hugging Face checkpoint directory: config.json, safetensors weights (sharded too), and
generation_config.json. Pickled weights (*.bin, *.pt, *.pth, *.ckpt) are refused, never unpickled.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional

import torch
from safetensors import safe_open

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                           "Gemma3ForCausalLM", "Gemma3ForConditionalGeneration")
MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen3MoeForCausalLM")  # backend/models/moe.py
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
# Gemma3TextConfig's defaults: the Hub's multimodal Gemma 3 configs leave most of text_config to them
GEMMA3_DEFAULTS = dict(vocab_size=262_208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                       num_attention_heads=8, num_key_value_heads=4, head_dim=256, rms_norm_eps=1e-6,
                       max_position_embeddings=131_072, query_pre_attn_scalar=256, sliding_window=4096,
                       hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True)
GEMMA3_PATTERN = 6  # sliding_window_pattern's default: five local layers, then a global one
GATED_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}  # HF name -> the kernel's


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: Optional[dict[str, Any]]
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    torch_dtype: str
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    bos_token_id: Optional[int] = None
    # packed GGUF weights (docs/quantization.md): HF module name -> GGUF type; None: float weights
    quantized_modules: Optional[dict[str, str]] = None
    # -- what sets the architectures apart (backend/models/llama.py reads these, docs/design.md) --
    # per layer: its sliding window (a local layer sees its last N positions), 0 for a global layer;
    # () when every layer is global
    layer_windows: tuple[int, ...] = ()
    local_rope_theta: Optional[float] = None  # local layers' RoPE base when it differs (Gemma 3)
    local_rope_scaling: Optional[dict[str, Any]] = None
    qk_norm: bool = False  # RMSNorm of each head of q and k before RoPE (Qwen3, Gemma 3)
    activation: str = "silu"  # the gated MLP's: silu or gelu_tanh (GeGLU)
    norm_weight_offset: float = 0.0  # Gemma's RMSNorm multiplies by (offset + w)
    sandwich_norms: bool = False  # Gemma: norms on the attention's and the MLP's outputs too
    embedding_scale: float = 1.0  # Gemma: embeddings times sqrt(hidden_size)
    query_pre_attn_scalar: Optional[float] = None  # attention scale ** -2 (Gemma); None: head_dim
    final_logit_softcapping: Optional[float] = None  # logits = cap * tanh(logits / cap)
    # mixture of experts (backend/models/moe.py); num_experts 0: every layer's MLP is dense
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0  # an expert's intermediate size (Mixtral: intermediate_size)
    norm_topk_prob: bool = True  # the top-k routing weights renormalized to sum to 1
    decoder_sparse_step: int = 1  # Qwen3-MoE: every n-th layer has experts ...
    mlp_only_layers: tuple[int, ...] = ()  # ... but these, which keep a dense MLP

    def is_moe_layer(self, layer: int) -> bool:
        """Whether `layer`'s MLP is a mixture of experts (transformers' rule for Qwen3-MoE; every
        layer of Mixtral)."""
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def window(self, layer: int) -> int:
        """Layer `layer`'s sliding window, 0 for full attention."""
        return self.layer_windows[layer] if self.layer_windows else 0


def _read_json(path: Path) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _as_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (int(value),)


def _rope(params: Optional[dict], theta: Any, scaling: Optional[dict]) -> tuple[float, Optional[dict]]:
    """(theta, scaling or None for the default rope) from HF's newer `rope_parameters` (one layer
    kind's) or its older `rope_theta` + `rope_scaling`."""
    if isinstance(params, dict):
        theta = params.get("rope_theta", theta)
        if params.get("rope_type", params.get("type", "default")) != "default":
            scaling = params
    if scaling and scaling.get("rope_type", scaling.get("type")) in (None, "default"):
        scaling = None
    return float(theta or 10000.0), scaling


def _layer_windows(cfg: dict[str, Any], arch: str, layers: int) -> tuple[int, ...]:
    """Each layer's sliding window (0: global), as transformers decides it for `arch`."""
    window = cfg.get("sliding_window")
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM") and not cfg.get("use_sliding_window", False):
        window = None
    if not window:
        return ()
    types = cfg.get("layer_types")
    if arch == "MistralForCausalLM":  # every layer slides (HF's Mistral reads no layer_types)
        types = ["sliding_attention"] * layers
    elif types is None and arch.startswith("Gemma3"):
        pattern = cfg.get("sliding_window_pattern", GEMMA3_PATTERN)
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    elif types is None:  # Qwen2/3: the layers from max_window_layers on
        first = cfg.get("max_window_layers", 28)
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    if len(types) != layers or set(types) - {"sliding_attention", "full_attention"}:
        raise ValueError(f"config.json: layer_types must list 'sliding_attention' or 'full_attention' for each "
                         f"of the {layers} layers; got {types}")
    windows = tuple(int(window) if t == "sliding_attention" else 0 for t in types)
    return windows if any(windows) else ()


def _gemma3(cfg: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3's text config with transformers' defaults filled in, its unsupported options refused."""
    cfg = {**GEMMA3_DEFAULTS, **cfg}
    if cfg.get("attn_logit_softcapping") is not None:
        raise ValueError("config.json: attn_logit_softcapping is set; inflight's attention kernels do not cap "
                         "attention scores (Gemma 3 has none; Gemma 2 is not supported)")
    if cfg.get("use_bidirectional_attention"):
        raise ValueError("config.json: use_bidirectional_attention (an embedding model) is not supported: "
                         "inflight serves causal decoders")
    return cfg


def load_model_config(model_dir: str | Path) -> ModelConfig:
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"model_path '{model_dir}' has no config.json (expected a Hugging Face checkpoint directory)")
    cfg = _read_json(model_dir / "config.json")
    archs = cfg.get("architectures") or []
    known = SUPPORTED_ARCHITECTURES + MOE_ARCHITECTURES
    arch = next((a for a in archs if a in known), None)
    if arch is None:
        raise ValueError(f"unsupported architecture {archs}; supported: {', '.join(known)}")
    top = cfg
    if arch == "Gemma3ForConditionalGeneration":  # the text model; the vision tower is not loaded
        cfg = dict(cfg.get("text_config") or {})
    gemma = arch.startswith("Gemma3")
    if gemma:
        cfg = _gemma3(cfg)
    num_heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
    is_qwen2 = arch == "Qwen2ForCausalLM"
    attention_bias = bool(cfg.get("attention_bias", False))
    gen_path = model_dir / "generation_config.json"
    gen = _read_json(gen_path) if gen_path.is_file() else {}
    eos = _as_ids(gen.get("eos_token_id", cfg.get("eos_token_id", top.get("eos_token_id"))))
    rope = cfg.get("rope_parameters")
    if gemma and isinstance(rope, dict) and "full_attention" in rope:  # one set per layer kind
        rope_theta, rope_scaling = _rope(rope["full_attention"], 1_000_000.0, None)
        local_theta, local_scaling = _rope(rope.get("sliding_attention"), 10_000.0, None)
    else:
        rope_theta, rope_scaling = _rope(rope, cfg.get("rope_theta", 1_000_000.0 if gemma else None),
                                         cfg.get("rope_scaling"))
        local_theta, local_scaling = float(cfg.get("rope_local_base_freq", 10_000.0)), None
    activation = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"
    if activation not in GATED_ACTIVATIONS:
        raise ValueError(f"config.json: activation {activation!r} is not supported; supported: "
                         f"{', '.join(GATED_ACTIVATIONS)}")
    layers = cfg["num_hidden_layers"]
    return ModelConfig(
        quantized_modules=_quantized_modules(top, model_dir),
        architecture=arch,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=layers,
        num_heads=num_heads,
        num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
        head_dim=head_dim,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(top.get("tie_word_embeddings", cfg.get("tie_word_embeddings", False))),
        qkv_bias=is_qwen2 or attention_bias,
        o_bias=attention_bias and not is_qwen2,
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or top.get("torch_dtype") or top.get("dtype")
                        or "float32"),
        eos_token_ids=eos,
        bos_token_id=gen.get("bos_token_id", cfg.get("bos_token_id", top.get("bos_token_id"))),
        layer_windows=_layer_windows(cfg, arch, layers),
        local_rope_theta=local_theta if gemma else None,
        local_rope_scaling=local_scaling if gemma else None,
        qk_norm=gemma or arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),  # Qwen3-MoE: Qwen3's attention
        activation=GATED_ACTIVATIONS[activation],
        norm_weight_offset=1.0 if gemma else 0.0,
        sandwich_norms=gemma,
        embedding_scale=cfg["hidden_size"] ** 0.5 if gemma else 1.0,
        query_pre_attn_scalar=float(cfg["query_pre_attn_scalar"]) if gemma else None,
        # transformers caps the logits in Gemma3ForCausalLM only: its multimodal class ignores the
        # text config's cap (real Gemma 3 checkpoints set none)
        final_logit_softcapping=cfg.get("final_logit_softcapping") if arch == "Gemma3ForCausalLM" else None,
        **_moe_fields(arch, cfg),
    )


def _moe_fields(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """The mixture-of-experts fields of a config.json (none for a dense architecture), checked."""
    if arch not in MOE_ARCHITECTURES:
        return {}
    mixtral = arch == "MixtralForCausalLM"
    experts = cfg.get("num_local_experts") if mixtral else (cfg.get("num_experts") or cfg.get("num_local_experts"))
    fields = dict(num_experts=experts, num_experts_per_tok=cfg.get("num_experts_per_tok"),
                  moe_intermediate_size=cfg.get("intermediate_size" if mixtral else "moe_intermediate_size"),
                  norm_topk_prob=True if mixtral else bool(cfg.get("norm_topk_prob", False)),
                  decoder_sparse_step=1 if mixtral else cfg.get("decoder_sparse_step", 1),
                  mlp_only_layers=() if mixtral else tuple(cfg.get("mlp_only_layers") or ()))
    for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step"):
        value = fields[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{arch} config.json: {key} must be an integer >= 1; got {value!r}")
    if fields["num_experts_per_tok"] > fields["num_experts"]:
        raise ValueError(f"{arch} config.json: num_experts_per_tok {fields['num_experts_per_tok']} exceeds the "
                         f"{fields['num_experts']} experts")
    return fields


PACKED_LAYOUTS = ("inflight-gguf-packed/1",)  # docs/quantization.md


def _quantized_modules(cfg: dict[str, Any], model_dir: Path) -> Optional[dict[str, str]]:
    quant = cfg.get("quantization_config")
    if not quant:
        return None
    method, layout = quant.get("quant_method"), quant.get("layout")
    if method != "gguf" or layout not in PACKED_LAYOUTS:
        raise ValueError(f"'{model_dir}': quantization_config {method!r} / layout {layout!r} is not one "
                         f"inflight reads (gguf, {', '.join(PACKED_LAYOUTS)}: `inflight import-gguf` writes it)")
    return dict(quant.get("modules") or {})


def weight_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint; refuses checkpoints that only have pickles."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(_read_json(index)["weight_map"].values()))
        files = [model_dir / s for s in shards]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"safetensors shards listed in the index are missing: {missing}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if files:
        return files
    pickles = [p.name for p in model_dir.iterdir() if p.suffix in PICKLE_SUFFIXES]
    if pickles:
        raise ValueError(f"refusing pickled weights {pickles} in '{model_dir}': inflight loads only "
                         "safetensors (pickles can run arbitrary code); convert the checkpoint to safetensors")
    raise FileNotFoundError(f"no *.safetensors weights in '{model_dir}'")


def iter_weights(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    for path in weight_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
