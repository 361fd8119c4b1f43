"""Rebuild a checkpoint's ``tokenizer.json`` from a GGUF file's tokenizer metadata.

A GGUF carries no tokenizer.json: llama.cpp stores the vocabulary (``tokenizer.ggml.tokens``), the
merges, each token's type (1 normal, 2 unknown, 3 control, 4 user-defined, 6 byte) and the special
token ids as metadata. This module turns those into a ``tokenizers.Tokenizer`` that tokenizes the
way transformers' GGUF loader does (``AutoTokenizer.from_pretrained(dir, gguf_file=...)``), which
tests/test_gguf_import.py checks on SmolLM2 and on a small written file.

Two tokenizer models are read:

- ``gpt2``: byte-level BPE (Llama 3, Qwen2, SmolLM2, GPT-2). Text is split by a regex and mapped to
  the byte alphabet before the merges. The regex depends on ``tokenizer.ggml.pre``, the name
  llama.cpp gives the split its merges were learned with; names not listed use GPT-2's own split.
- ``llama``: SentencePiece-style BPE (Llama 2, Mistral): "▁" for spaces, one prepended, bytes
  that are not in the vocabulary fall back to ``<0xNN>`` tokens. The merges come from the file or,
  when it has none, from the vocabulary ranked by score.

Control tokens become special added tokens (matched whole, skipped when decoding with
``skip_special_tokens``); user-defined ones become plain added tokens.
"""
from __future__ import annotations

import numbers
from typing import Any, Optional

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models
from tokenizers import pre_tokenizers, processors

from backend.models.checkpoint_config import shown

CONTROL, USER_DEFINED = 3, 4

# The splits llama.cpp knows by name (its `tokenizer.ggml.pre`), written as regular expressions.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZER_SPLITS = {
    "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT, "dbrx": _LLAMA3_SPLIT, "pixtral": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT,
}
SUPPORTED_TOKENIZER_MODELS = ("gpt2", "llama")

_SPECIAL_ID_KEYS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id",
                    "unk_token": "unknown_token_id", "pad_token": "padding_token_id"}


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's map from the 256 byte values to printable characters (the byte-level alphabet)."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


_LISTS = {"tokenizer.ggml.tokens": (str, "strings"), "tokenizer.ggml.merges": (str, "'left right' strings"),
          "tokenizer.ggml.scores": (numbers.Real, "numbers"), "tokenizer.ggml.token_type": (numbers.Integral, "integers")}


def check_metadata(meta: dict[str, Any]) -> None:
    """The tokenizer keys read here are of their types, the ids within the token list; else a
    ValueError naming the key (the importer then writes no tokenizer, and says why)."""
    if meta.get("tokenizer.ggml.tokens") is None:
        raise ValueError("tokenizer.ggml.tokens is missing: the file has no vocabulary")
    for key, (kind, what) in _LISTS.items():
        value = meta.get(key)
        if value is not None and (not isinstance(value, list) or not all(
                isinstance(v, kind) and not isinstance(v, bool) and (kind is not str or key != "tokenizer.ggml.merges"
                                                                     or " " in v) for v in value)):
            raise ValueError(f"{key} is {shown(value)}; it must be a list of {what}")
    tokens, scores = meta.get("tokenizer.ggml.tokens") or [], meta.get("tokenizer.ggml.scores")
    if scores is not None and len(scores) != len(tokens):
        raise ValueError(f"tokenizer.ggml.scores has {len(scores)} entries; it must have one per token ({len(tokens)})")
    for key in _SPECIAL_ID_KEYS.values():
        value = meta.get(f"tokenizer.ggml.{key}")
        if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Integral)
                                  or key == "unknown_token_id" and not 0 <= value < len(tokens)):
            raise ValueError(f"tokenizer.ggml.{key} is {shown(value)}; it must be a token id in 0..{len(tokens) - 1}")
    for key in ("tokenizer.ggml.add_space_prefix", "tokenizer.ggml.add_bos_token"):
        if meta.get(key) is not None and not isinstance(meta[key], bool):
            raise ValueError(f"{key} is {shown(meta[key])}; it must be true or false")
    for key in ("tokenizer.ggml.pre", "tokenizer.chat_template"):
        if meta.get(key) is not None and not isinstance(meta[key], str):
            raise ValueError(f"{key} is {shown(meta[key])}; it must be a string")


def _merges(meta: dict[str, Any]) -> list[tuple[str, str]]:
    return [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or []]


def _byte_level(meta: dict[str, Any]) -> Tokenizer:
    alphabet = _byte_alphabet()
    letters = set(alphabet.values())
    # Tokens are stored already spelled in the byte alphabet; a rare one that is not (a raw control
    # token with a space, say) is respelled so that the vocabulary stays one id per entry.
    vocab = {(t if set(t) <= letters else "".join(alphabet[b] for b in t.encode("utf-8"))): i
             for i, t in enumerate(meta["tokenizer.ggml.tokens"])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=_merges(meta), fuse_unk=False))
    split = PRE_TOKENIZER_SPLITS.get(meta.get("tokenizer.ggml.pre", ""))
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    return tok


def _ranked_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """Merges implied by a scored vocabulary: every split of a token into two known pieces,
    best-scored result first (how SentencePiece BPE ranks them)."""
    vocab = {t: i for i, t in enumerate(tokens)}
    found = []
    for token, rank in vocab.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                found.append((-float(scores[rank]), rank, vocab[left], vocab[right], left, right))
    found.sort()
    return [(left, right) for *_, left, right in found]


def _sentencepiece(meta: dict[str, Any]) -> Tokenizer:
    tokens = list(meta["tokenizer.ggml.tokens"])
    merges = _merges(meta) or _ranked_merges(tokens, meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens))
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if unk_id is not None else None
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                               unk_token=unk, fuse_unk=True, byte_fallback=True))
    prepend = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if prepend else "never", split=False)
    tok.normalizer = None
    strip = [decoders.Strip(content=" ", left=1, right=0)] if prepend else []
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), *strip])
    return tok


def special_tokens(meta: dict[str, Any]) -> dict[str, Optional[str]]:
    """bos_token / eos_token / unk_token / pad_token as strings, from the file's ids."""
    tokens = meta["tokenizer.ggml.tokens"]
    out: dict[str, Optional[str]] = {}
    for name, key in _SPECIAL_ID_KEYS.items():
        token_id = meta.get(f"tokenizer.ggml.{key}")
        out[name] = tokens[token_id] if token_id is not None and 0 <= token_id < len(tokens) else None
    return out


def build_tokenizer(meta: dict[str, Any]) -> Tokenizer:
    """The ``tokenizers.Tokenizer`` a GGUF's metadata describes (``meta``: key -> value).

    Raises ValueError naming ``tokenizer.ggml.model`` for a model other than gpt2 or llama.
    """
    check_metadata(meta)
    kind = meta.get("tokenizer.ggml.model")
    if "tokenizer.ggml.tokens" not in meta or kind not in SUPPORTED_TOKENIZER_MODELS:
        raise ValueError(f"tokenizer.ggml.model {kind!r} is not supported; supported: "
                         f"{', '.join(SUPPORTED_TOKENIZER_MODELS)}")
    try:
        tok = _byte_level(meta) if kind == "gpt2" else _sentencepiece(meta)
    except Exception as exc:  # tokenizers' own errors are plain Exceptions (a merge of unknown tokens)
        raise ValueError(f"tokenizer.ggml.tokens and tokenizer.ggml.merges make no BPE model: {exc}") from None
    types = list(meta.get("tokenizer.ggml.token_type") or [])
    tokens = meta["tokenizer.ggml.tokens"]
    letters = set(_byte_alphabet().values())
    # A control token spelled outside the byte alphabet is a mislabel in a byte-level vocabulary
    # (adding it would create a new id); transformers skips those too.
    control = [AddedToken(t, normalized=False, special=True) for t, kind_ in zip(tokens, types)
               if kind_ == CONTROL and (kind != "gpt2" or set(t) <= letters)]
    if control:
        tok.add_special_tokens(control)
    user = [AddedToken(t, normalized=False, special=False) for t, kind_ in zip(tokens, types)
            if kind_ == USER_DEFINED]
    if user:
        tok.add_tokens(user)
    bos = special_tokens(meta)["bos_token"]
    if kind == "llama" and bos is not None and meta.get("tokenizer.ggml.add_bos_token", True):
        # SentencePiece files prepend BOS unless they say otherwise (llama.cpp's default).
        bos_id = tok.token_to_id(bos)
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, bos_id)])
    else:
        # Byte-level files: transformers adds nothing (its post-processor has no special tokens),
        # whatever tokenizer.ggml.add_bos_token says; a chat template writes its own markers.
        tok.post_processor = processors.TemplateProcessing(single="$A:0", pair="$A:0 $B:1",
                                                           special_tokens=[])
    return tok


def tokenizer_config(meta: dict[str, Any]) -> dict[str, Any]:
    """``tokenizer_config.json``: the special tokens and the chat template."""
    check_metadata(meta)
    config: dict[str, Any] = {k: v for k, v in special_tokens(meta).items() if v is not None}
    template = meta.get("tokenizer.chat_template")
    if template:
        config["chat_template"] = template
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config["clean_up_tokenization_spaces"] = False
    return config
