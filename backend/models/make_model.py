"""Write the embedded default model: a small random-weight Llama checkpoint in exact HF format.

``make_model(out_dir, seed=0)`` writes, in well under a second on a laptop CPU:

- ``tokenizer.json``: a byte-level BPE (vocab 2000 with ``<unk>``, ``<s>``, ``</s>`` at ids 0, 1, 2)
  trained with the ``tokenizers`` library on ``backend/models/data/corpus.txt``, which ships in the repo.
  Its post-processor prepends ``<s>``; its decoder is byte-level. Training is deterministic, so the
  file does not depend on the seed and is byte-identical from run to run.
- ``tokenizer_config.json``, ``special_tokens_map.json``: what ``AutoTokenizer`` needs
  (``PreTrainedTokenizerFast``, as Llama 3 checkpoints use).
- ``config.json``, ``generation_config.json``: ``LlamaForCausalLM`` with GQA (8 query heads, 2 KV
  heads), head_dim 32, 4 layers, hidden 256.
- ``model.safetensors``: seeded random normal weights under HF parameter names, norms = 1.

The weight scales (see the constants below) keep the random model's logits well separated: the
median top-1/top-2 gap of the logits is ~0.6 while fp32 rounding moves them by ~1e-5, so greedy
decoding does not hinge on summation order, and the context matters enough that a KV-cache mix-up
changes the output.

Nothing here imports transformers; the checkpoint is written with ``safetensors`` and ``json``.
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any, Sequence

import torch
from safetensors.torch import save_file

CORPUS_PATH = Path(__file__).resolve().parent / "data" / "corpus.txt"

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")  # ids 0, 1, 2, as in Llama 2
UNK_TOKEN, BOS_TOKEN, EOS_TOKEN = SPECIAL_TOKENS
TOKENIZER_VOCAB_SIZE = 2000

# Weight scales. The input of every projection is RMS-normalized (RMS ~1), so a projection drawn with
# std GAIN / sqrt(fan_in) outputs values of RMS ~GAIN. Measured against float64 (see the report in
# tests/test_make_model.py): the fp32 logit error is ~1e-5 while the median top-1/top-2 logit gap is
# ~0.6 (1st percentile ~0.01), changing one token 59 positions back changes the next greedy token
# about half the time (attention matters), and greedy continuations do not collapse into loops.
# std 0.02 everywhere (the HF default) gives gaps ~10x smaller and near-constant outputs.
EMBED_STD = 0.5
QK_GAIN = 1.0  # attention-score std ~1: sharper attention amplifies rounding with length
VO_GAIN = 1.6
MLP_GAIN = 1.6
LM_HEAD_STD = 0.2  # logits' std ~ LM_HEAD_STD * sqrt(hidden_size) = 3.2

DEFAULT_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "hidden_act": "silu",
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "mlp_bias": False,
    "pretraining_tp": 1,
    "tie_word_embeddings": False,
    "initializer_range": LM_HEAD_STD,
    "use_cache": True,
    "torch_dtype": "float32",
}

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


# ----------------------------------------------------------------------------------------------
# Tokenizer
# ----------------------------------------------------------------------------------------------

def train_tokenizer(vocab_size: int = TOKENIZER_VOCAB_SIZE, corpus_path: Path = CORPUS_PATH):
    """Train the byte-level BPE on the shipped corpus. Deterministic: same corpus, same bytes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    text = corpus_path.read_text(encoding="utf-8")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # One paragraph per item, in file order: the trainer's result does not depend on thread timing.
    tok.train_from_iterator([p for p in text.split("\n\n") if p], trainer=trainer)
    bos_id = tok.token_to_id(BOS_TOKEN)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN}:0 $A:0",
        pair=f"{BOS_TOKEN}:0 $A:0 {BOS_TOKEN}:1 $B:1",
        special_tokens=[(BOS_TOKEN, bos_id)],
    )
    return tok


def _tokenizer_files(tok, model_max_length: int) -> dict[str, Any]:
    added = {
        str(tok.token_to_id(t)): {
            "content": t, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": True,
        }
        for t in SPECIAL_TOKENS
    }
    tokenizer_config = {
        "add_bos_token": True,
        "add_eos_token": False,
        "added_tokens_decoder": added,
        "bos_token": BOS_TOKEN,
        "clean_up_tokenization_spaces": False,
        "eos_token": EOS_TOKEN,
        "model_max_length": model_max_length,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": UNK_TOKEN,
    }
    special_tokens_map = {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "unk_token": UNK_TOKEN}
    return {"tokenizer_config.json": tokenizer_config, "special_tokens_map.json": special_tokens_map}


# ----------------------------------------------------------------------------------------------
# Weights
# ----------------------------------------------------------------------------------------------

def _config_for(tok, shape_overrides: dict[str, Any]) -> dict[str, Any]:
    unknown = set(shape_overrides) - set(DEFAULT_CONFIG) - {"vocab_size"}
    if unknown:
        raise TypeError(f"make_model: unknown config override(s) {sorted(unknown)}; "
                        f"known: {sorted(set(DEFAULT_CONFIG) | {'vocab_size'})}")
    cfg = dict(DEFAULT_CONFIG)
    cfg["vocab_size"] = tok.get_vocab_size()
    cfg["bos_token_id"] = tok.token_to_id(BOS_TOKEN)
    cfg["eos_token_id"] = tok.token_to_id(EOS_TOKEN)
    if "head_dim" not in shape_overrides and (
            "hidden_size" in shape_overrides or "num_attention_heads" in shape_overrides):
        cfg["head_dim"] = None  # recomputed below from the overridden shape
    cfg.update(shape_overrides)
    if cfg["head_dim"] is None:
        cfg["head_dim"] = cfg["hidden_size"] // cfg["num_attention_heads"]
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings"):
        if not isinstance(cfg[key], int) or isinstance(cfg[key], bool) or cfg[key] <= 0:
            raise ValueError(f"make_model: {key} must be a positive int, got {cfg[key]!r}")
    if cfg["num_attention_heads"] % cfg["num_key_value_heads"]:
        raise ValueError("make_model: num_attention_heads must be a multiple of num_key_value_heads")
    if cfg["vocab_size"] < tok.get_vocab_size():
        raise ValueError(f"make_model: vocab_size {cfg['vocab_size']} is smaller than the "
                         f"tokenizer's {tok.get_vocab_size()}")
    if cfg["torch_dtype"] not in _DTYPES:
        raise ValueError(f"make_model: torch_dtype must be one of {sorted(_DTYPES)}")
    cfg["initializer_range"] = float(cfg["initializer_range"])
    return cfg


def make_weights(cfg: dict[str, Any], seed: int = 0, eos_boost: float = 1.0) -> dict[str, torch.Tensor]:
    """Seeded random weights under HF Llama names (float32, then cast to cfg['torch_dtype']).
    `eos_boost` scales the EOS row of the output projection: > 1 makes the model end often (its
    EOS logit grows in magnitude, so EOS wins wherever it was positive), for tests of EOS handling."""
    gen = torch.Generator().manual_seed(int(seed))
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    nq, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    vocab = cfg["vocab_size"]

    def normal(shape: tuple[int, ...], std: float) -> torch.Tensor:
        return torch.randn(shape, generator=gen, dtype=torch.float32) * std

    def proj(out_f: int, in_f: int, gain: float) -> torch.Tensor:
        return normal((out_f, in_f), gain / math.sqrt(in_f))

    w: dict[str, torch.Tensor] = {"model.embed_tokens.weight": normal((vocab, h), EMBED_STD)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "self_attn.q_proj.weight"] = proj(nq * hd, h, QK_GAIN)
        w[p + "self_attn.k_proj.weight"] = proj(nkv * hd, h, QK_GAIN)
        w[p + "self_attn.v_proj.weight"] = proj(nkv * hd, h, VO_GAIN)
        w[p + "self_attn.o_proj.weight"] = proj(h, nq * hd, VO_GAIN)
        w[p + "mlp.gate_proj.weight"] = proj(inter, h, MLP_GAIN)
        w[p + "mlp.up_proj.weight"] = proj(inter, h, MLP_GAIN)
        w[p + "mlp.down_proj.weight"] = proj(h, inter, MLP_GAIN)
        w[p + "input_layernorm.weight"] = torch.ones(h)
        w[p + "post_attention_layernorm.weight"] = torch.ones(h)
    w["model.norm.weight"] = torch.ones(h)
    if not cfg["tie_word_embeddings"]:
        w["lm_head.weight"] = normal((vocab, h), LM_HEAD_STD)
    if eos_boost != 1.0:
        if cfg["tie_word_embeddings"]:
            raise ValueError("make_model: eos_boost needs untied embeddings (tie_word_embeddings false)")
        w["lm_head.weight"][cfg["eos_token_id"]] *= eos_boost
    dtype = _DTYPES[cfg["torch_dtype"]]
    return {k: v.to(dtype).contiguous() for k, v in w.items()}


# ----------------------------------------------------------------------------------------------
# Entry points
# ----------------------------------------------------------------------------------------------

def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n",
                    encoding="utf-8")


def make_model(out_dir: str | Path, seed: int = 0, eos_boost: float = 1.0, **shape_overrides: Any) -> Path:
    """Write the default random Llama checkpoint (HF format) into ``out_dir`` and return its path.

    ``shape_overrides`` replace keys of ``config.json`` (e.g. ``num_hidden_layers=2``,
    ``num_key_value_heads=8``, ``hidden_size=128``, ``tie_word_embeddings=True``,
    ``torch_dtype="bfloat16"``, ``rope_scaling={...}``, or a ``vocab_size`` at least the
    tokenizer's). Same arguments, byte-identical files.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer()
    cfg = _config_for(tok, shape_overrides)

    tok.save(str(out / "tokenizer.json"), pretty=True)
    for name, obj in _tokenizer_files(tok, cfg["max_position_embeddings"]).items():
        _write_json(out / name, obj)
    _write_json(out / "config.json", cfg)
    _write_json(out / "generation_config.json",
                {"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"]})
    save_file(make_weights(cfg, seed, eos_boost), str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def _parse_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def build_parser(prog: str = "inflight make-model") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Write a small random-weight Llama checkpoint (HF format: config.json, "
                    "model.safetensors, tokenizer.json, ...) for tests and demos.")
    parser.add_argument("--out", required=True, help="output directory (created if missing)")
    parser.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    parser.add_argument("--eos-boost", type=float, default=1.0,
                        help="scale the EOS row of the output projection (> 1: a model that ends "
                             "often, for testing EOS handling; default 1)")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE",
                        help="override a config.json key, value parsed as JSON "
                             "(e.g. --set num_hidden_layers=2 --set torch_dtype=bfloat16); "
                             "repeatable")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """CLI: ``inflight make-model --out DIR [--seed N] [--set KEY=VALUE ...]``."""
    args = build_parser().parse_args(argv)
    overrides: dict[str, Any] = {}
    for item in args.overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            build_parser().error(f"--set expects KEY=VALUE, got {item!r}")
        overrides[key.strip()] = _parse_value(value)
    try:
        path = make_model(args.out, seed=args.seed, eos_boost=args.eos_boost, **overrides)
    except (TypeError, ValueError) as exc:
        build_parser().error(str(exc))
    cfg = json.loads((path / "config.json").read_text())
    print(f"wrote {path} (llama, {cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']}, "
          f"vocab {cfg['vocab_size']}, seed {args.seed})")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
