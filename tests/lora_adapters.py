"""LoRA adapters for the tests, written by PEFT itself (its own layout: adapter_config.json and
adapter_model.safetensors), and the oracle: transformers with the adapter merged into the base
weights by PEFT's merge_and_unload.

The adapters' weights are random (seeded), lora_B included (PEFT starts it at zero, which would
make every adapter the base model), scaled so an adapter changes the greedy tokens without making
near ties: lora_A rows have unit norm on average and lora_B's std is `b_std`.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from hf_checkpoints import hf_greedy  # noqa: E402

ALL_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class AdapterSpec:
    r: int = 8
    alpha: float = 16.0
    targets: tuple[str, ...] = ALL_MODULES
    use_rslora: bool = False
    b_std: float = 0.05
    rank_pattern: dict = field(default_factory=dict)
    alpha_pattern: dict = field(default_factory=dict)
    layers: Optional[tuple[int, ...]] = None  # PEFT's layers_to_transform


def _base(base_dir: Path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()


def make_adapter(base_dir: Path, out_dir: Path, seed: int, spec: AdapterSpec = AdapterSpec()) -> Path:
    """Write a PEFT adapter for the checkpoint at base_dir into out_dir, with PEFT's save_pretrained."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=spec.r, lora_alpha=spec.alpha, target_modules=list(spec.targets), lora_dropout=0.0,
                        bias="none", use_rslora=spec.use_rslora, rank_pattern=dict(spec.rank_pattern),
                        alpha_pattern=dict(spec.alpha_pattern), task_type="CAUSAL_LM",
                        layers_to_transform=list(spec.layers) if spec.layers is not None else None)
    model = get_peft_model(_base(base_dir), config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if "lora_A" in name:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5)
            elif "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * spec.b_std)
    model.save_pretrained(out_dir)
    assert (Path(out_dir) / "adapter_model.safetensors").is_file()
    return Path(out_dir)


def checkpoint_with_adapters(base_dir: Path, root: Path, names: tuple[str, ...], seed: int,
                             spec: AdapterSpec = AdapterSpec(),
                             listed: Optional[tuple[str, ...]] = None) -> tuple[Path, dict[str, Path]]:
    """A served checkpoint folder, root/ckpt: the base's files linked, and a multi_lora.json (the vLLM
    backend's file) naming `listed` (default: all) of the adapters `names`, written under root with
    seeds seed, seed + 1, ... Returns (the folder, {name: adapter folder})."""
    import json

    folder = Path(root) / "ckpt"
    folder.mkdir()
    for f in Path(base_dir).iterdir():
        (folder / f.name).symlink_to(f)
    adapters = {name: make_adapter(base_dir, Path(root) / name, seed=seed + i, spec=spec) for i, name in enumerate(names)}
    (folder / "multi_lora.json").write_text(json.dumps({n: str(adapters[n]) for n in (listed or names)}))
    return folder, adapters


def merged_greedy(base_dir: Path, adapter_dir: Optional[Path], prompts: list[list[int]],
                  max_tokens: list[int]) -> list[list[int]]:
    """The oracle: transformers' greedy tokens with the adapter merged into the base weights by
    PEFT (merge_and_unload); the base model alone when adapter_dir is None."""
    model = _base(base_dir)
    if adapter_dir is not None:
        from peft import PeftModel
        model = PeftModel.from_pretrained(model, str(adapter_dir)).merge_and_unload()
    return hf_greedy(model, prompts, max_tokens)


def merged_oracle(base_dir: Path, adapters: dict, prompts: list[list[int]], names: list[Optional[str]],
                  max_tokens: int) -> list[list[int]]:
    """The merged models' greedy tokens for each (prompt, adapter name or None), one merge per adapter."""
    out: list = [None] * len(prompts)
    for name in dict.fromkeys(names):
        idx = [i for i, n in enumerate(names) if n == name]
        got = merged_greedy(base_dir, adapters[name] if name else None, [prompts[i] for i in idx], [max_tokens] * len(idx))
        for i, tokens in zip(idx, got):
            out[i] = tokens
    return out


def record_steps(llm):
    """The adapters (and whether base rows were there) of each step the runner ran."""
    seen = []
    manager = llm.engine.runner.lora
    inner = manager.step

    def step(runs, writes, num_rows):  # runs by slot: the slots' holders name the adapters
        rows = sum(e - s for s, e, _ in runs)
        seen.append(({manager.bank.holder[slot] for _, _, slot in runs}, rows < num_rows))
        return inner(runs, writes, num_rows)

    manager.step = step
    return seen
