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

from backend.models import mrope
from backend.models.checkpoint_config import (MOE_ARCHITECTURES, CheckpointConfigError, Reader, model_fields,
                                               shown)
from backend.models.weight_shapes import check_against_weights, header_shapes
from kernels.quant_reference import ARRAYS

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                           "Gemma3ForCausalLM", "Gemma3ForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration")
# Pooling checkpoints (docs/pooling.md): a bare decoder (sentence-transformers' embedding models) or one
# with a score head (cross-encoder rerankers) -> the causal architecture whose decoder it is.
POOLING_ARCHITECTURES = {f"{base}{kind}": f"{base}ForCausalLM" for base in ("Llama", "Qwen2", "Qwen3")
                         for kind in ("Model", "ForSequenceClassification")}
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
# Gemma3TextConfig's defaults: the Hub's multimodal Gemma 3 configs leave most of text_config to them
GEMMA3_DEFAULTS = dict(vocab_size=262_208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                       num_attention_heads=8, num_key_value_heads=4, head_dim=256, rms_norm_eps=1e-6,
                       max_position_embeddings=131_072, query_pre_attn_scalar=256, sliding_window=4096,
                       hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True)


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
    # a GGUF F16/BF16 file's folder (config.json's gguf_float_type, backend/models/gguf/importer.py):
    # dtype=auto keeps torch_dtype on the CPU too (backend/worker/device.py resolve_dtype)
    keeps_dtype_on_cpu: bool = False
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
    # pooling checkpoints: "" a causal LM; "none" a bare decoder (no LM head); "score" a score head
    # of num_labels outputs (*ForSequenceClassification); its architectures entry as written
    head: str = ""
    num_labels: int = 0
    # a score head made of two LM-head rows (vLLM's classifier_from_token, Qwen3-Reranker's ["no", "yes"]):
    # the tokens as config.json names them, and their ids once the engine has read the tokenizer
    classifier_tokens: tuple[str, ...] = ()
    classifier_token_ids: tuple[int, ...] = ()
    checkpoint_architecture: str = ""
    # Qwen2.5-VL: the rotary half's (time, height, width) sections (backend/models/mrope.py); (): 1-D RoPE
    mrope_section: tuple[int, ...] = ()

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
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (ValueError, RecursionError) as exc:  # not JSON, not UTF-8, or nested past the parser
        raise CheckpointConfigError(f"{path.name} is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise CheckpointConfigError(f"{path.name} is {shown(value)}; it must be a JSON object")
    return value


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
    """config.json (and generation_config.json) of a checkpoint, every value checked
    (backend/models/checkpoint_config.py) and its counts held to the weights' shapes
    (backend/models/weight_shapes.py) before anything is allocated."""
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"model_path '{model_dir}' has no config.json (expected a Hugging Face checkpoint directory)")
    cfg = _read_json(model_dir / "config.json")
    archs = cfg.get("architectures") or []
    known = SUPPORTED_ARCHITECTURES + MOE_ARCHITECTURES + tuple(POOLING_ARCHITECTURES)
    arch = next((a for a in archs if a in known), None) if isinstance(archs, list) else None
    written, arch = arch, POOLING_ARCHITECTURES.get(arch, arch)
    if arch is None:
        raise CheckpointConfigError(f"config.json: architectures is {shown(archs)}; it must list one of "
                                    f"{', '.join(known)}")
    top, mrope_section = cfg, ()
    if arch == "Gemma3ForConditionalGeneration":  # the text model; the vision tower is not loaded
        text = Reader(cfg).mapping("text_config")
        cfg = dict(text.cfg) if text else {}
    elif arch == "Qwen2_5_VLForConditionalGeneration":  # a Qwen2 decoder with M-RoPE (backend/models/mrope.py)
        (cfg, mrope_section), arch = mrope.text_config(cfg), "Qwen2ForCausalLM"
    gemma = arch.startswith("Gemma3")
    if gemma:
        cfg = _gemma3(cfg)
    gen_path = model_dir / "generation_config.json"
    gen = _read_json(gen_path) if gen_path.is_file() else {}
    fields = model_fields(cfg, arch, top, gen)
    is_qwen2 = arch == "Qwen2ForCausalLM"
    attention_bias = fields.pop("attention_bias")
    model_config = ModelConfig(
        quantized_modules=_quantized_modules(top, model_dir),
        keeps_dtype_on_cpu=top.get("gguf_float_type") in ("F16", "BF16"),
        architecture=arch,
        qkv_bias=is_qwen2 or attention_bias,
        o_bias=attention_bias and not is_qwen2,
        torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or top.get("torch_dtype") or top.get("dtype")
                        or "float32"),
        qk_norm=gemma or arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),  # Qwen3-MoE: Qwen3's attention
        norm_weight_offset=1.0 if gemma else 0.0,
        sandwich_norms=gemma,
        embedding_scale=fields["hidden_size"] ** 0.5 if gemma else 1.0,
        checkpoint_architecture=written, mrope_section=mrope_section, **_pooling_head(written, top),
        **fields,
    )
    if mrope_section:
        mrope.check_section(mrope_section, model_config.head_dim)
    files = _weight_files_if_any(model_dir)
    if files:
        check_against_weights(model_config, header_shapes(files))
    return model_config


def _pooling_head(written: str, cfg: dict[str, Any]) -> dict[str, Any]:
    if written.endswith("Model"):
        return {"head": "none"}
    if not written.endswith("ForSequenceClassification"):
        return {}
    tokens = cfg.get("classifier_from_token")
    if tokens is not None:  # vLLM's: score = logit(tokens[1]) - logit(tokens[0]), one label (docs/pooling.md)
        if not (isinstance(tokens, list) and len(tokens) == 2 and all(isinstance(t, str) and t for t in tokens)):
            raise CheckpointConfigError(f"config.json: classifier_from_token is {shown(tokens)}; it must be two "
                                        "token strings (Qwen3-Reranker's [\"no\", \"yes\"])")
        return {"head": "score", "num_labels": 1, "classifier_tokens": tuple(tokens)}
    labels = cfg.get("num_labels", len(cfg.get("id2label") or {}) or 2)  # transformers writes id2label
    if isinstance(labels, bool) or not isinstance(labels, int) or not 1 <= labels <= 1024:
        raise CheckpointConfigError(f"config.json: num_labels is {shown(labels)}; it must be an integer in [1, 1024]")
    return {"head": "score", "num_labels": labels}


def _weight_files_if_any(model_dir: Path) -> list[Path]:
    """The checkpoint's safetensors files, or none (a folder of config files only: loading its weights
    fails later, naming what is missing)."""
    try:
        return weight_files(model_dir)
    except (FileNotFoundError, ValueError):
        return []


PACKED_LAYOUTS = ("inflight-gguf-packed/1",)  # docs/quantization.md


def _quantized_modules(cfg: dict[str, Any], model_dir: Path) -> Optional[dict[str, str]]:
    quant = Reader(cfg).mapping("quantization_config")
    if quant is None or not quant.cfg:
        return None
    method, layout = quant.cfg.get("quant_method"), quant.cfg.get("layout")
    if method != "gguf" or layout not in PACKED_LAYOUTS:
        raise ValueError(f"'{model_dir}': quantization_config {shown(method)} / layout {shown(layout)} is not one "
                         f"inflight reads (gguf, {', '.join(PACKED_LAYOUTS)}: `inflight import-gguf` writes it)")
    modules = quant.cfg.get("modules") or {}
    if not isinstance(modules, dict) or any(not isinstance(t, str) or t not in ARRAYS for t in modules.values()):
        quant.fail("modules", modules, f"an object of module name -> packed type ({', '.join(ARRAYS)})")
    return dict(modules)


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
