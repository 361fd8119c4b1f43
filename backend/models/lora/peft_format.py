"""Read a PEFT LoRA adapter folder (adapter_config.json + adapter_model.safetensors) and check it
against the base model; never unpickle (an adapter_model.bin alone is refused).

What is supported is what the Llama family's projections take: q/k/v/o_proj and gate/up/down_proj
of any layers, any rank up to `max_lora_rank` (per module too: PEFT's rank_pattern and
alpha_pattern), scaling lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora. Anything else
(DoRA, LoRA biases, modules_to_save, embedding or lm_head adapters, layer replication) is refused
naming the adapter and the module, as is a tensor whose shape does not fit the base model.

Everything read is checked before use: `r` and `lora_alpha` (and rank_pattern / alpha_pattern,
whose keys must be valid regular expressions) must be numbers of the right kind, the tensors 2-D
floating point, non-empty and finite (a NaN or Inf weight would turn every output to garbage), the
file a readable safetensors file. Every refusal is one ValueError line: "LoRA adapter 'NAME'
(FOLDER): the problem".

The engine fuses q/k/v into `qkv_proj` and gate/up into `gate_up_proj` (backend/models/llama.py):
an adapter's modules are grouped the same way here, one shard per HF module, so their deltas land
on the right column slices of the fused output.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
from safetensors import SafetensorError, safe_open

from backend.models.loader import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# fused projection -> its shards (HF module names), as LlamaForCausalLM.packed_modules_mapping
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
         "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
SHARD_OF = {hf: (fused, i) for fused, shards in FUSED.items() for i, hf in enumerate(shards)}
PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
          "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
_TENSOR = re.compile(r"^(?:base_model\.model\.)?(?P<module>(?:model\.)?layers\.(?P<layer>\d+)\.(?P<parent>self_attn|mlp)"
                     r"\.(?P<hf>\w+))\.lora_(?P<ab>[AB])(?:\.default)?\.weight$")

# where a tensor name's module path ends (PEFT's parts and the parameter's own name)
_MARKER = re.compile(r"\.(?:lora_\w+|base_layer|modules_to_save|original_module|weight|bias)(?:\.|$)")


@dataclass
class LoRAAdapter:
    """One adapter's weights on the host, float32, grouped like the engine's projections:
    (layer, fused projection) -> one (A [r, in], B [out, r] x scaling) per shard, None for a shard
    the adapter does not touch."""
    name: str
    path: str
    rank: int  # the largest of its modules' ranks
    weights: dict[tuple[int, str], list[Optional[tuple[torch.Tensor, torch.Tensor]]]] = field(default_factory=dict)
    modules: tuple[str, ...] = ()  # the HF module names it targets (q_proj, ...)

    @property
    def num_bytes(self) -> int:
        return sum(a.numel() * 4 + b.numel() * 4 for parts in self.weights.values() for p in parts if p
                   for a, b in [p])


def shard_sizes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """HF module -> (in features, out features) in this base model."""
    q, kv, h, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.hidden_size, cfg.intermediate_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}


def _pattern_value(patterns: dict, module: str, default):
    """PEFT's rank_pattern / alpha_pattern lookup: a key matches the module's name exactly or as
    the end of its dotted path (a regex; checked by read_config)."""
    for key, value in (patterns or {}).items():
        if key == module or re.fullmatch(rf"(.*\.)?(?:{key})", module):
            return value
    return default


def _refuse(name: str, folder: Path, what: str) -> ValueError:
    return ValueError(f"LoRA adapter '{name}' ({folder}): {what}")


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check_numbers(name: str, folder: Path, config: dict) -> None:
    """r and lora_alpha, and their per-module patterns: the types PEFT writes, in range."""
    def rank_ok(v):
        return _is_number(v) and float(v).is_integer() and v >= 1

    if not rank_ok(config.get("r", 8)):
        raise _refuse(name, folder, f"r must be an integer >= 1; got {config.get('r')!r}")
    if not _is_number(config.get("lora_alpha", 8)):
        raise _refuse(name, folder, f"lora_alpha must be a finite number; got {config.get('lora_alpha')!r}")
    if not isinstance(config.get("use_rslora", False), bool):
        raise _refuse(name, folder, f"use_rslora must be true or false; got {config.get('use_rslora')!r}")
    for key, ok, what in (("rank_pattern", rank_ok, "an integer >= 1"), ("alpha_pattern", _is_number, "a finite number")):
        patterns = config.get(key) or {}
        if not isinstance(patterns, dict):
            raise _refuse(name, folder, f"{key} must be an object of module pattern -> value; got {patterns!r}")
        for pattern, value in patterns.items():
            try:
                re.compile(pattern)
            except re.error as exc:
                raise _refuse(name, folder, f"{key} key {pattern!r} is not a valid regular expression ({exc})") from None
            if not ok(value):
                raise _refuse(name, folder, f"{key}[{pattern!r}] must be {what}; got {value!r}")


def read_config(name: str, folder: Path) -> dict:
    if not folder.is_dir():
        raise _refuse(name, folder, "no adapter folder there")
    path = folder / CONFIG_FILE
    if not path.is_file():
        raise _refuse(name, folder, f"no {CONFIG_FILE} (a PEFT adapter folder holds {CONFIG_FILE} and {WEIGHTS_FILE})")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as exc:
        raise _refuse(name, folder, f"{CONFIG_FILE} is not readable JSON ({type(exc).__name__}: {exc})") from None
    if not isinstance(config, dict):
        raise _refuse(name, folder, f"{CONFIG_FILE} must hold a JSON object")
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise _refuse(name, folder, f"peft_type is {peft_type}; only LORA adapters are served")
    unsupported = {
        "use_dora": (bool(config.get("use_dora")), "DoRA (use_dora) is not supported"),
        "bias": (config.get("bias", "none") not in ("none", None), f"bias={config.get('bias')!r}: LoRA biases are not supported"),
        "lora_bias": (bool(config.get("lora_bias")), "lora_bias is not supported"),
        "fan_in_fan_out": (bool(config.get("fan_in_fan_out")), "fan_in_fan_out (Conv1D layers) does not fit Llama's linear layers"),
        "modules_to_save": (bool(config.get("modules_to_save")),
                            f"modules_to_save {config.get('modules_to_save')} (fully trained copies of whole modules) are not supported"),
        "layer_replication": (bool(config.get("layer_replication")), "layer_replication is not supported"),
        "target_parameters": (bool(config.get("target_parameters")), "target_parameters is not supported"),
    }
    for _, (bad, why) in unsupported.items():
        if bad:
            raise _refuse(name, folder, why)
    _check_numbers(name, folder, config)
    return config


def load_adapter(name: str, path: str, cfg: ModelConfig, max_lora_rank: int) -> LoRAAdapter:
    """Read and check one adapter folder against the base model (its config `cfg`); any problem is
    one ValueError line naming the adapter, its folder and the problem."""
    folder = Path(path).expanduser()
    try:
        return _load(name, folder, cfg, max_lora_rank)
    except ValueError as exc:
        if str(exc).startswith(f"LoRA adapter '{name}'"):
            raise
        raise _refuse(name, folder, f"{type(exc).__name__}: {exc}") from None
    except Exception as exc:  # a library's error on a damaged file: still one line naming the adapter
        raise _refuse(name, folder, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") from None


def _read_tensors(name: str, folder: Path, cfg: ModelConfig) -> dict[tuple[str, str], torch.Tensor]:
    weights_path = folder / WEIGHTS_FILE
    if not weights_path.is_file():
        pickled = [p.name for p in folder.glob("adapter_model.*") if p.suffix in (".bin", ".pt", ".pth", ".ckpt")]
        hint = (f" ({', '.join(pickled)} is a pickle and is never loaded: save it again with PEFT's "
                "save_pretrained(safe_serialization=True))") if pickled else ""
        raise _refuse(name, folder, f"no {WEIGHTS_FILE}{hint}")
    found: dict[tuple[str, str], torch.Tensor] = {}
    try:
        with safe_open(str(weights_path), framework="pt") as f:
            keys = list(f.keys())
            for key in keys:
                m = _TENSOR.match(key)
                if m is None:
                    module = _MARKER.split(key.removeprefix("base_model.model."), 1)[0]
                    raise _refuse(name, folder, f"module '{module}' (tensor {key}) is not supported: LoRA is served on "
                                                f"{', '.join(SHARD_OF)} of the decoder layers")
                hf, layer = m["hf"], int(m["layer"])
                if hf not in SHARD_OF or PARENT[hf] != m["parent"]:
                    raise _refuse(name, folder, f"module '{m['module']}' is not supported: LoRA is served on "
                                                f"{', '.join(SHARD_OF)}")
                if layer >= cfg.num_layers:
                    raise _refuse(name, folder, f"module '{m['module']}': the base model has {cfg.num_layers} layers")
                if PARENT[hf] == "mlp" and cfg.is_moe_layer(layer):
                    raise _refuse(name, folder, f"module '{m['module']}': layer {layer}'s MLP is a mixture of "
                                                "experts, which LoRA does not reach (its attention projections it does)")
                found[(m["module"].removeprefix("model."), m["ab"])] = _checked(name, folder, key, f.get_tensor(key))
    except (OSError, SafetensorError) as exc:  # truncated, corrupt, not a safetensors file at all
        raise _refuse(name, folder, f"{WEIGHTS_FILE} is not a readable safetensors file ({exc})") from None
    if not found:
        raise _refuse(name, folder, f"{WEIGHTS_FILE} holds no LoRA weights")
    return found


def _checked(name: str, folder: Path, key: str, tensor: torch.Tensor) -> torch.Tensor:
    """A LoRA matrix: 2-D, not empty, floating point, every value finite."""
    if tensor.dim() != 2 or tensor.numel() == 0:
        raise _refuse(name, folder, f"tensor {key} has shape {tuple(tensor.shape)}; a LoRA weight is a non-empty matrix")
    if not tensor.is_floating_point():
        raise _refuse(name, folder, f"tensor {key} is {tensor.dtype}; LoRA weights are floating point")
    finite = torch.isfinite(tensor)
    if not bool(finite.all()):
        bad = int((~finite).sum())
        raise _refuse(name, folder, f"tensor {key} holds {bad} NaN or infinite value(s)")
    return tensor


def _load(name: str, folder: Path, cfg: ModelConfig, max_lora_rank: int) -> LoRAAdapter:
    config = read_config(name, folder)
    found = _read_tensors(name, folder, cfg)
    sizes = shard_sizes(cfg)
    adapter = LoRAAdapter(name, str(folder), 0)
    modules = set()
    for (module, ab), tensor in sorted(found.items()):
        if ab == "B":
            continue
        b = found.get((module, "B"))
        if b is None:
            raise _refuse(name, folder, f"module '{module}' has lora_A but no lora_B")
        a = tensor
        hf = module.rsplit(".", 1)[-1]
        fan_in, fan_out = sizes[hf]
        rank = a.shape[0]
        if tuple(a.shape) != (rank, fan_in) or tuple(b.shape) != (fan_out, rank):
            raise _refuse(name, folder, f"module '{module}': lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not "
                                        f"fit the base model's {hf} ({fan_in} -> {fan_out}): expected ({rank}, {fan_in}) "
                                        f"and ({fan_out}, {rank}); was it trained for another model?")
        r = int(_pattern_value(config.get("rank_pattern"), "model." + module, config.get("r", 8)))
        if r != rank:
            raise _refuse(name, folder, f"module '{module}': its weights have rank {rank}, its config says r={r}")
        if rank > max_lora_rank:
            raise _refuse(name, folder, f"module '{module}' has rank {rank}, above max_lora_rank={max_lora_rank}")
        alpha = float(_pattern_value(config.get("alpha_pattern"), "model." + module, config.get("lora_alpha", 8)))
        scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
        layer = int(module.split(".")[1])
        fused, shard = SHARD_OF[hf]
        parts = adapter.weights.setdefault((layer, fused), [None] * len(FUSED[fused]))
        scaled_b = (b.float() * scaling).contiguous()
        if not bool(torch.isfinite(scaled_b).all()):  # finite weights, but a huge alpha overflows them
            raise _refuse(name, folder, f"module '{module}': lora_B x scaling ({scaling:g}) overflows float32")
        parts[shard] = (a.float().contiguous(), scaled_b)
        adapter.rank = max(adapter.rank, rank)
        modules.add(hf)
    orphan = next((m for m, ab in found if ab == "B" and (m, "A") not in found), None)
    if orphan is not None:
        raise _refuse(name, folder, f"module '{orphan}' has lora_B but no lora_A")
    adapter.modules = tuple(sorted(modules, key=list(SHARD_OF).index))
    return adapter
