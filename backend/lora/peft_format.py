"""Read a PEFT LoRA adapter folder (adapter_config.json + adapter_model.safetensors) and check it
against the base model; never unpickle (an adapter_model.bin alone is refused).

What is supported is what the Llama family's projections take: q/k/v/o_proj and gate/up/down_proj
of any layers, any rank up to `max_lora_rank` (per module too: PEFT's rank_pattern and
alpha_pattern), scaling lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora. Anything else
(DoRA, LoRA biases, modules_to_save, embedding or lm_head adapters, layer replication) is refused
naming the adapter and the module, as is a tensor whose shape does not fit the base model.

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
from safetensors import safe_open

from backend.loader import ModelConfig

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
    the end of its dotted path (a regex)."""
    for key, value in (patterns or {}).items():
        if key == module or re.fullmatch(rf"(.*\.)?(?:{key})", module):
            return value
    return default


def _refuse(name: str, what: str) -> ValueError:
    return ValueError(f"LoRA adapter '{name}': {what}")


def read_config(name: str, folder: Path) -> dict:
    if not folder.is_dir():
        raise _refuse(name, f"no adapter folder at {folder}")
    path = folder / CONFIG_FILE
    if not path.is_file():
        raise _refuse(name, f"{folder} has no {CONFIG_FILE} (a PEFT adapter folder holds {CONFIG_FILE} and {WEIGHTS_FILE})")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise _refuse(name, f"{path} is not readable JSON ({exc})") from None
    if not isinstance(config, dict):
        raise _refuse(name, f"{path} must hold a JSON object")
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise _refuse(name, f"peft_type is {peft_type}; only LORA adapters are served")
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
            raise _refuse(name, why)
    return config


def load_adapter(name: str, path: str, cfg: ModelConfig, max_lora_rank: int) -> LoRAAdapter:
    """Read and check one adapter folder against the base model (its config `cfg`)."""
    folder = Path(path).expanduser()
    config = read_config(name, folder)
    weights_path = folder / WEIGHTS_FILE
    if not weights_path.is_file():
        pickled = [p.name for p in folder.glob("adapter_model.*") if p.suffix in (".bin", ".pt", ".pth", ".ckpt")]
        hint = (f" ({', '.join(pickled)} is a pickle and is never loaded: save it again with PEFT's "
                "save_pretrained(safe_serialization=True))") if pickled else ""
        raise _refuse(name, f"{folder} has no {WEIGHTS_FILE}{hint}")
    sizes = shard_sizes(cfg)
    found: dict[tuple[str, str], torch.Tensor] = {}
    with safe_open(str(weights_path), framework="pt") as f:
        for key in f.keys():
            m = _TENSOR.match(key)
            if m is None:
                module = _MARKER.split(key.removeprefix("base_model.model."), 1)[0]
                raise _refuse(name, f"module '{module}' (tensor {key}) is not supported: LoRA is served on "
                                    f"{', '.join(SHARD_OF)} of the decoder layers")
            hf, layer = m["hf"], int(m["layer"])
            if hf not in SHARD_OF or PARENT[hf] != m["parent"]:
                raise _refuse(name, f"module '{m['module']}' is not supported: LoRA is served on {', '.join(SHARD_OF)}")
            if layer >= cfg.num_layers:
                raise _refuse(name, f"module '{m['module']}': the base model has {cfg.num_layers} layers")
            if PARENT[hf] == "mlp" and cfg.is_moe_layer(layer):
                raise _refuse(name, f"module '{m['module']}': layer {layer}'s MLP is a mixture of experts, which "
                                    "LoRA does not reach (its attention projections it does)")
            found[(m["module"].removeprefix("model."), m["ab"])] = f.get_tensor(key)
    if not found:
        raise _refuse(name, f"{weights_path} holds no LoRA weights")
    adapter = LoRAAdapter(name, str(folder), 0)
    modules = set()
    for (module, ab), tensor in sorted(found.items()):
        if ab == "B":
            continue
        b = found.get((module, "B"))
        if b is None:
            raise _refuse(name, f"module '{module}' has lora_A but no lora_B")
        a = tensor
        hf = module.rsplit(".", 1)[-1]
        fan_in, fan_out = sizes[hf]
        rank = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or tuple(a.shape) != (rank, fan_in) or tuple(b.shape) != (fan_out, rank):
            raise _refuse(name, f"module '{module}': lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit "
                                f"the base model's {hf} ({fan_in} -> {fan_out}): expected ({rank}, {fan_in}) and "
                                f"({fan_out}, {rank}); was it trained for another model?")
        r = int(_pattern_value(config.get("rank_pattern"), "model." + module, config.get("r", 8)))
        if r != rank:
            raise _refuse(name, f"module '{module}': its weights have rank {rank}, its config says r={r}")
        if rank > max_lora_rank:
            raise _refuse(name, f"module '{module}' has rank {rank}, above max_lora_rank={max_lora_rank}")
        alpha = float(_pattern_value(config.get("alpha_pattern"), "model." + module, config.get("lora_alpha", 8)))
        scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
        layer = int(module.split(".")[1])
        fused, shard = SHARD_OF[hf]
        parts = adapter.weights.setdefault((layer, fused), [None] * len(FUSED[fused]))
        parts[shard] = (a.float().contiguous(), (b.float() * scaling).contiguous())
        adapter.rank = max(adapter.rank, rank)
        modules.add(hf)
    orphan = next((m for m, ab in found if ab == "B" and (m, "A") not in found), None)
    if orphan is not None:
        raise _refuse(name, f"module '{orphan}' has lora_B but no lora_A")
    adapter.modules = tuple(sorted(modules, key=list(SHARD_OF).index))
    return adapter
