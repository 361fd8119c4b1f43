"""Tiny random pooling checkpoints for the pooling tests (docs/pooling.md): Qwen3 embedding models
with sentence-transformers files, and a Qwen3 cross-encoder (Qwen3ForSequenceClassification), with
their oracles computed from transformers' hidden states and score head."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch

from hf_checkpoints import COMMON, SHAPES

_MODES = {"last": "pooling_mode_lasttoken", "mean": "pooling_mode_mean_tokens", "cls": "pooling_mode_cls_token"}


def sentence_transformers_files(out_dir: Path, pooling: str, normalize: bool, hidden: int) -> None:
    """modules.json, 1_Pooling/config.json (and 2_Normalize) as sentence-transformers writes them."""
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
        (out_dir / "2_Normalize").mkdir(exist_ok=True)
    (out_dir / "modules.json").write_text(json.dumps(modules))
    (out_dir / "1_Pooling").mkdir(exist_ok=True)
    settings = {"word_embedding_dimension": hidden, "include_prompt": True,
                **{key: name == pooling for name, key in _MODES.items()}}
    (out_dir / "1_Pooling" / "config.json").write_text(json.dumps(settings))


def qwen3_pooling_checkpoint(out_dir: Path, kind: str, seed: int = 0, pooling: str = "last", normalize: bool = True,
                             num_labels: int = 1, sentence_transformers: bool = True, **config) -> Path:
    """kind: "model" (a bare Qwen3Model, as sentence-transformers saves Qwen3-Embedding), "causal" (a
    Qwen3ForCausalLM: it can generate too) or "classify" (Qwen3ForSequenceClassification)."""
    import transformers as tf
    torch.manual_seed(seed)
    cfg = tf.Qwen3Config(**{**COMMON, **SHAPES["qwen3"], **config})
    if kind == "classify":
        cfg.num_labels = num_labels
    cls = {"model": tf.Qwen3Model, "causal": tf.Qwen3ForCausalLM, "classify": tf.Qwen3ForSequenceClassification}[kind]
    model = cls(cfg).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(1, 0.3)
            elif name.endswith("score.weight"):
                param.normal_(0, 0.5)
    model.save_pretrained(out_dir, safe_serialization=True)
    if kind != "classify" and sentence_transformers:
        sentence_transformers_files(out_dir, pooling, normalize, cfg.hidden_size)
    return out_dir


def with_tokenizer(path: Path, source: Path) -> Path:
    """`path` with the tokenizer files of `source` (the default model's: vocab 2000) copied in."""
    import shutil
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(Path(source) / name, Path(path) / name)
    return path


def hf_hidden(model_dir: Path, prompt: list[int]) -> torch.Tensor:
    """transformers' last hidden state (after the final norm) of one prompt, float32 [T, hidden]."""
    from transformers import AutoModel
    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([prompt])).last_hidden_state[0]


def hf_embeddings(model_dir: Path, prompts: list[list[int]], pooling: str, normalize: bool,
                  dimensions: Optional[int] = None) -> list[torch.Tensor]:
    """sentence-transformers' pooling by hand over transformers' hidden states."""
    from transformers import AutoModel
    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for prompt in prompts:
            h = model(torch.tensor([prompt])).last_hidden_state[0]
            v = {"last": h[-1], "mean": h.mean(dim=0), "cls": h[0]}[pooling]
            v = v[:dimensions] if dimensions else v
            out.append(torch.nn.functional.normalize(v, dim=-1) if normalize else v)
    return out


def hf_scores(model_dir: Path, prompts: list[list[int]]) -> list[float]:
    """transformers' sequence-classification logits through a sigmoid (one label: vLLM's and
    sentence-transformers' CrossEncoder's activation)."""
    from transformers import AutoModelForSequenceClassification
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return [torch.sigmoid(model(torch.tensor([p])).logits[0, 0]).item() for p in prompts]


def hf_last_logits(model_dir: Path, prompts: list[list[int]]) -> list[torch.Tensor]:
    """transformers' causal-LM logits at each prompt's last position, float32."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(torch.tensor([p])).logits[0, -1] for p in prompts]
