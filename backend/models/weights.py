"""The model with its weights in the form the engine runs them: float (oneDNN-packed on CPU), kept
quantized as a GGUF import packed them (docs/quantization.md), or quantized at load (int8).

The runner calls `load_model` once; everything about weight formats lives here, so the runner only
sees a model, the rows a step is padded to and what the weights cost. On CPU the activations are
float32 whatever the weights are (`compute_dtype`): bf16 weights run oneDNN's bf16 GEMMs on the
float32 activations cast at each GEMM, packed weights the C kernels of kernels/cpu/quant.py, and the
norms, RoPE and attention stay the float32 C kernels either way.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch
from torch import nn

from backend.core.config import EngineConfig
from backend.models.loader import ModelConfig, iter_weights
from backend.models.llama import LlamaForCausalLM
from backend.models.cpu_weight_choice import choose_for_checkpoint
from backend.models.float_linear import float_linears
from backend.models.moe import (checkpoint_name, dequantized_experts, install_packed_experts, is_stacked_expert,
                                pack_experts)
from backend.models.packed_linear import PackedLinear, can_pack, pack_linears, padded_rows
from backend.models.quant_linear import (ConcatLinear, QuantEmbedding, QuantLinear, concat_parts, describe,
                                         fused_module_name)
from backend.models.quantize_at_load import quantize_fp8_at_load, quantize_int8
from kernels.quant_reference import ARRAYS, dequantize

log = logging.getLogger(__name__)
FP8_MIN_CAPABILITY = (8, 9)  # e4m3 conversions in hardware: Ada, Hopper (kernels/gpu/quant_w8_gemm.py)
PACKED_ARRAYS = {name for names in ARRAYS.values() for name in names}


@dataclass
class LoadedModel:
    model: LlamaForCausalLM
    padded_rows: Callable[[int], int]  # rows a step of n tokens is padded to (oneDNN's buckets)
    quantization: str  # none | gguf | int8 | fp8: what the engine does
    weight_bytes: int  # resident bytes of every weight, as held (packed, reordered or plain)
    summary: str  # one line for the log and `inflight serve`


def compute_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The activations' dtype: float32 on CPU for float32, bfloat16 and float16 weights (the C
    kernels are float32; float_gemm.c widens 16-bit weights, bf16 GEMMs take their inputs cast),
    the weights' dtype elsewhere."""
    return torch.float32 if device.type == "cpu" and dtype in (torch.float32, torch.bfloat16, torch.float16) else dtype


KV_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def kv_cache_dtype(setting: str, dtype: torch.dtype, device: torch.device, quantization: str = "none") -> torch.dtype:
    """The KV cache's dtype: ``kv_cache_dtype``; for auto, the engine's ``dtype``, but bfloat16 beside
    quantized weights on CPU: there the attention's reads of a float32 cache outweigh the weights'
    (32 sequences of 200 tokens: 300 MB a step against SmolLM2's 97 MB of Q4_1), and llama.cpp keeps
    its cache in 16 bits too (docs/quantization.md has the perplexity and the speed); and beside
    float16 weights on CPU, whose 16 bits the C attention reads as bfloat16 (it has no float16)."""
    if setting == "auto":
        return torch.bfloat16 if device.type == "cpu" and (quantization != "none" or dtype == torch.float16) else dtype
    if setting in ("fp8", "fp8_e4m3"):
        require_fp8_gpu(f"kv_cache_dtype={setting}", device, on_cpu=", where bfloat16 halves the cache",
                        instead="bfloat16 or auto")
        return torch.float8_e4m3fn  # e4m3, values saturated to +-448, no scale (kernels/gpu/store_kv.py)
    return KV_DTYPES[setting]


def resolve_quantization(requested: str, model_cfg: ModelConfig, device: torch.device) -> str:
    packed = model_cfg.quantized_modules is not None
    if requested == "auto":
        return "gguf" if packed else "none"
    if requested == "gguf" and not packed:
        raise ValueError("quantization=gguf needs a checkpoint with packed GGUF weights (written by "
                         "`inflight import-gguf`); this one has float weights (quantization=int8 quantizes them)")
    if requested in ("int8", "fp8") and packed:
        raise ValueError(f"quantization={requested} quantizes float weights; this checkpoint is already "
                         "quantized (gguf); use auto, gguf, or none to dequantize it")
    if requested == "fp8" and model_cfg.num_experts:
        raise ValueError(f"quantization=fp8 does not cover mixture-of-experts layers (the fused-MoE kernel "
                         f"reads bf16/fp16 experts; {model_cfg.architecture} has {model_cfg.num_experts} "
                         "experts per layer): use none, or int8")
    if requested == "fp8":
        require_fp8_gpu("quantization=fp8", device, on_cpu=" (int8 is the CPU's weight-only quantization)",
                        instead="int8 or none")
    return requested


def require_fp8_gpu(setting: str, device: torch.device, on_cpu: str, instead: str) -> None:
    """ValueError naming `setting` unless `device` is a CUDA GPU with e4m3 in hardware; `on_cpu` ends
    the CPU's message, `instead` names what an older GPU can use."""
    if device.type != "cuda":
        raise ValueError(f"{setting} needs a CUDA GPU with fp8 support (compute capability 8.9+, Ada or Hopper); "
                         f"this engine runs on {device.type}{on_cpu}")
    capability = tuple(torch.cuda.get_device_capability(device))
    if capability < FP8_MIN_CAPABILITY:
        raise ValueError(f"{setting} needs compute capability 8.9 or newer (Ada, Hopper); {device} "
                         f"has {capability[0]}.{capability[1]}: use {instead}")


def _split_packed(weights, modules: dict[str, str]) -> Iterator[tuple[str, object]]:
    """(name, tensor) for float tensors and (module, (qtype, arrays)) once all of a packed module's
    arrays have arrived (they may sit in different shards)."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        prefix, _, part = name.rpartition(".")
        if prefix in modules and part in PACKED_ARRAYS:
            arrays = pending.setdefault(prefix, {})
            arrays[part] = tensor
            if set(arrays) >= set(ARRAYS[modules[prefix]]):
                yield prefix, (modules[prefix], pending.pop(prefix))
        else:
            yield name, tensor
    if pending:
        first = next(iter(pending))
        raise ValueError(f"packed weight '{first}' lacks arrays: has {sorted(pending[first])}, a "
                         f"{modules[first]} needs {list(ARRAYS[modules[first]])}")


def _dequantized(items, dtype: torch.dtype):
    """quantization=none on a packed checkpoint (``items``: `_split_packed`'s): every packed module
    as a float ``.weight`` (stacked experts as each expert's)."""
    for name, item in items:
        if not isinstance(item, tuple):
            yield name, item
        elif is_stacked_expert(name):
            yield from dequantized_experts(name, item[0], item[1], dtype, dequantize)
        else:
            yield f"{name}.weight", dequantize(item[0], item[1]).to(dtype)


def _install_packed(model: LlamaForCausalLM, items, device) -> list:
    """Replace the model's linear layers (and embedding) packed in ``items`` (`_split_packed`'s) by
    QuantLinear modules; return the float tensors for load_weights."""
    floats, packed, experts = [], {}, {}
    for name, item in items:
        if isinstance(item, tuple):
            (experts if is_stacked_expert(name) else packed)[name] = (item[0], {k: v.to(device) for k, v in item[1].items()})
        else:
            floats.append((name, item))
    install_packed_experts(model, experts)
    groups: dict[str, list[str]] = {}
    for hf in packed:
        groups.setdefault(fused_module_name(hf) or hf, []).append(hf)
    order = {"q_proj": 0, "k_proj": 1, "v_proj": 2, "gate_proj": 0, "up_proj": 1}
    for target, members in groups.items():
        members.sort(key=lambda hf: order.get(hf.rsplit(".", 1)[-1], 0))
        module_name = checkpoint_name(target.removeprefix("model."))
        if module_name == "embed_tokens":
            continue
        old = model.get_submodule(module_name)
        bias = getattr(old, "bias", None) is not None
        types = {packed[m][0] for m in members}
        if len(members) != (3 if target.endswith("qkv_proj") else 2 if target.endswith("gate_up_proj") else 1):
            raise ValueError(f"packed checkpoint: {target} has parts {members}, not all of them packed")
        if len(types) == 1:
            new = QuantLinear(types.pop(), concat_parts([packed[m][1] for m in members]), bias=bias)
        else:  # different types in one fused projection: one GEMM per part
            new = ConcatLinear([QuantLinear(*packed[m]) for m in members], bias=bias)
        parent, _, child = module_name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, new)
    if "model.embed_tokens" in packed:
        qtype, arrays = packed["model.embed_tokens"]
        tied = "lm_head" not in packed and (model.cfg.tie_word_embeddings or not any(n == "lm_head.weight" for n, _ in floats))
        table = QuantLinear(qtype, arrays)
        model.embed_tokens = QuantEmbedding(table)
        if tied:
            model.lm_head = table
    return floats


def _weight_bytes(model: nn.Module) -> int:
    seen, total = set(), 0
    for module in model.modules():
        if isinstance(module, QuantLinear) and id(module) not in seen:
            seen.add(id(module))
            total += module.weight_bytes
        elif isinstance(module, PackedLinear):
            total += module.packed.numel() * module.packed.element_size()
    for t in list(model.parameters()) + list(model.buffers()):
        total += t.numel() * t.element_size()
    return total


def load_model(config: EngineConfig, model_cfg: ModelConfig, device: torch.device,
               dtype: torch.dtype, ops_name: str, tensor_device: Optional[torch.device] = None,
               tp=None) -> LoadedModel:
    """Build the model for ``device`` with weights of ``dtype`` (float ones), quantized or not as
    ``config.quantization`` says, from ``config.model_path``. The tensors live on ``tensor_device``
    (default ``device``): the GPU rehearsal keeps them on the CPU while every choice is the GPU's.
    ``tp``: a tensor-parallel group; ``model_cfg`` is then its rank's shard (backend/parallel/), the
    weights are cut as they are read and the model's seams get their collectives."""
    quantization = resolve_quantization(config.quantization, model_cfg, device)
    modules = model_cfg.quantized_modules or {}
    place = tensor_device or device
    with torch.device("meta"):  # no host copy, no random init: every weight is loaded below
        model = LlamaForCausalLM(model_cfg).to(dtype)
    model = model.to_empty(device=place)
    weights = iter_weights(config.model_path)
    if tp is not None:
        weights = tp.plan.shard_weights(weights)
    items, choice = _split_packed(weights, modules) if modules else weights, None
    if config.quantization == "auto" and quantization == "gguf" and device.type == "cpu" and tp is None:
        items = list(items)  # held anyway: the packed path installs them all at once
        choice = choose_for_checkpoint(items, model_cfg, dtype, _float32_bytes(model_cfg) * dtype.itemsize // 4)
        quantization = choice.quantization
    if quantization == "gguf":
        items = _install_packed(model, items, place)
    elif modules:  # none on a packed checkpoint: dequantized here
        items = _dequantized(items, dtype)
    model.load_weights(items)
    compute = compute_dtype(dtype, device)
    model.compute_dtype = compute
    if compute != dtype:  # norms and biases in the activations' dtype, for the C kernels
        for module in model.modules():
            for name, param in list(module.named_parameters(recurse=False)):
                if param.dim() == 1:
                    setattr(module, name, nn.Parameter(param.detach().to(compute), requires_grad=False))
    if quantization == "int8":
        quantize_int8(model)
    elif quantization == "fp8":
        quantize_fp8_at_load(model)
    rows: Callable[[int], int] = lambda n: n  # noqa: E731
    floats = float_linears(model) if device.type == "cpu" and ops_name == "cpu" else 0  # issue 47: float_gemm.c, TP too
    if can_pack(device, dtype) and (ops_name == "cpu" or compute != dtype):  # (bf16 weights need one of the two)
        pack_linears(model)  # the float linears left: oneDNN GEMMs on reordered weights
        pack_experts(model)  # and float experts: one oneDNN GEMM per active expert
        if quantization == "none" and ops_name == "cpu" and not floats:
            rows = padded_rows  # each step padded once to oneDNN's row buckets
    if tp is not None:
        from backend.models.parallel.layers import parallelize
        parallelize(model, tp.plan, tp)
    weight_bytes = _weight_bytes(model)
    float32_bytes, name = _float32_bytes(model_cfg), str(dtype).removeprefix("torch.")
    kind = {"gguf": f"gguf ({describe(modules)})", "int8": "int8 (Q8_0: int8, a float16 scale per 32)",
            "fp8": f"fp8 (e4m3, a float32 scale per output channel; embedding and lm_head {name})",
            "none": f"none ({name}{', dequantized from gguf: faster here' if choice else ''})"}[quantization]
    summary = (f"quantization={kind}; resident weights {weight_bytes / 1e6:.1f} MB "
               f"({weight_bytes / float32_bytes:.0%} of float32's {float32_bytes / 1e6:.1f} MB)")
    log.info("weights: %s", summary)
    return LoadedModel(model.eval(), rows, quantization, weight_bytes, summary)


def _float32_bytes(cfg: ModelConfig) -> int:
    """What the same model's weights take in float32 (a tied lm_head counted once)."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    per_layer = cfg.hidden_size * (q + 2 * kv) + q * cfg.hidden_size
    per_layer += 2 * cfg.hidden_size + (q + 2 * kv if cfg.qkv_bias else 0)
    moe = sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers))
    experts = cfg.num_experts * 3 * cfg.hidden_size * cfg.moe_intermediate_size + cfg.num_experts * cfg.hidden_size
    total = cfg.num_layers * per_layer + moe * experts + (cfg.num_layers - moe) * 3 * cfg.hidden_size * cfg.intermediate_size
    total += cfg.vocab_size * cfg.hidden_size + cfg.hidden_size
    if not cfg.tie_word_embeddings:
        total += cfg.vocab_size * cfg.hidden_size
    return 4 * total
