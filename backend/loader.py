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

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen3MoeForCausalLM")  # backend/models/moe.py
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


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
    sliding_window: Optional[int] = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    bos_token_id: Optional[int] = None
    # packed GGUF weights (docs/quantization.md): HF module name -> GGUF type; None: float weights
    quantized_modules: Optional[dict[str, str]] = None
    qk_norm: bool = False  # RMSNorm of each head of q and k before RoPE (Qwen3, Gemma 3)
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


def _read_json(path: Path) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _as_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (int(value),)


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
    num_heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
    is_qwen2 = arch == "Qwen2ForCausalLM"
    attention_bias = bool(cfg.get("attention_bias", False))
    sliding = cfg.get("sliding_window")
    if is_qwen2 and not cfg.get("use_sliding_window", False):
        sliding = None
    gen_path = model_dir / "generation_config.json"
    gen = _read_json(gen_path) if gen_path.is_file() else {}
    eos = _as_ids(gen.get("eos_token_id", cfg.get("eos_token_id")))
    rope_scaling = cfg.get("rope_scaling")
    rope_theta = cfg.get("rope_theta")
    if rope_theta is None and isinstance(cfg.get("rope_parameters"), dict):  # newer HF layout
        rope_theta = cfg["rope_parameters"].get("rope_theta")
        if cfg["rope_parameters"].get("rope_type", "default") != "default":
            rope_scaling = cfg["rope_parameters"]
    if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type")) in (None, "default"):
        rope_scaling = None
    return ModelConfig(
        quantized_modules=_quantized_modules(cfg, model_dir),
        architecture=arch,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
        head_dim=head_dim,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope_theta or 10000.0),
        rope_scaling=rope_scaling,
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=is_qwen2 or attention_bias,
        o_bias=attention_bias and not is_qwen2,
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
        sliding_window=sliding,
        eos_token_ids=eos,
        bos_token_id=gen.get("bos_token_id", cfg.get("bos_token_id")),
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
                  mlp_only_layers=() if mixtral else tuple(cfg.get("mlp_only_layers") or ()),
                  qk_norm=not mixtral)   # Qwen3-MoE's attention is Qwen3's
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
