"""Tokenization for the engine: a thin layer over the ``tokenizers`` library.

``Tokenizer`` loads a checkpoint's ``tokenizer.json`` (+ ``tokenizer_config.json``) and encodes the
way ``transformers.AutoTokenizer(...)(text)["input_ids"]`` does for Llama / Mistral / Qwen2-style
checkpoints, without importing transformers:

- the ``tokenizer.json`` post-processor adds the special tokens (e.g. Llama's ``<s>``); as in
  transformers 5 it is authoritative, and ``tokenizer_config.json``'s ``add_bos_token`` /
  ``add_eos_token`` only matter for a tokenizer.json without a post-processor;
- the special tokens named in ``tokenizer_config.json`` are registered as special added tokens, so
  they are matched whole in the text and skipped by ``decode(..., skip_special_tokens=True)``.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence, Union

from tokenizers import AddedToken, processors
from tokenizers import Tokenizer as _HFTokenizer

__all__ = ["Tokenizer"]

_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token",
                 "mask_token")


def _token_str(value: Any) -> Optional[str]:
    """A special token from tokenizer_config.json: a string or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _added_token(value: Any) -> Optional[AddedToken]:
    content = _token_str(value)
    if content is None:
        return None
    if isinstance(value, dict):
        return AddedToken(content, single_word=bool(value.get("single_word", False)),
                          lstrip=bool(value.get("lstrip", False)),
                          rstrip=bool(value.get("rstrip", False)),
                          normalized=bool(value.get("normalized", False)), special=True)
    return AddedToken(content, normalized=False, special=True)


class Tokenizer:
    """A checkpoint's tokenizer: ``encode`` / ``decode`` / ``vocab_size`` / special token ids."""

    def __init__(self, backend: _HFTokenizer, config: Optional[dict] = None,
                 name_or_path: Optional[str] = None):
        self._tok = backend
        self.config: dict = dict(config or {})
        self.name_or_path = name_or_path
        self._register_special_tokens()
        self._apply_bos_eos_flags()
        self.bos_token: Optional[str] = _token_str(self.config.get("bos_token"))
        self.eos_token: Optional[str] = _token_str(self.config.get("eos_token"))
        self.bos_token_id: Optional[int] = self._id_of(self.bos_token)
        self.eos_token_id: Optional[int] = self._id_of(self.eos_token)
        self.pad_token_id: Optional[int] = self._id_of(_token_str(self.config.get("pad_token")))
        self.all_special_ids: frozenset[int] = frozenset(
            i for i, t in self._tok.get_added_tokens_decoder().items() if t.special)

    # -- construction ---------------------------------------------------------------------------
    @classmethod
    def from_dir(cls, path: Union[str, Path]) -> Optional["Tokenizer"]:
        """Load ``<path>/tokenizer.json`` (and ``tokenizer_config.json`` if present).

        Returns None when the directory has no tokenizer.json (token-id-only checkpoints).
        """
        path = Path(path)
        tj = path / "tokenizer.json"
        if not tj.is_file():
            return None
        config: dict = {}
        tc = path / "tokenizer_config.json"
        if tc.is_file():
            config = json.loads(tc.read_text(encoding="utf-8"))
        jinja = path / "chat_template.jinja"  # where transformers 5 saves the chat template
        if not config.get("chat_template") and jinja.is_file():
            config["chat_template"] = jinja.read_text(encoding="utf-8")
        return cls(_HFTokenizer.from_file(str(tj)), config, name_or_path=str(path))

    def _id_of(self, token: Optional[str]) -> Optional[int]:
        return None if token is None else self._tok.token_to_id(token)

    def _register_special_tokens(self) -> None:
        """Make the config's special tokens special added tokens, as transformers does on load."""
        present = {t.content for t in self._tok.get_added_tokens_decoder().values()}
        wanted: list[AddedToken] = []
        decoder = self.config.get("added_tokens_decoder") or {}
        for _, spec in sorted(decoder.items(), key=lambda kv: int(kv[0])):
            tok = _added_token(spec)
            if tok is not None and tok.content not in present and (
                    not isinstance(spec, dict) or spec.get("special", True)):
                wanted.append(tok)
                present.add(tok.content)
        extra = self.config.get("additional_special_tokens") or []
        for value in [self.config.get(k) for k in _SPECIAL_KEYS] + list(extra):
            tok = _added_token(value)
            if tok is not None and tok.content not in present:
                wanted.append(tok)
                present.add(tok.content)
        if wanted:
            self._tok.add_special_tokens(wanted)

    def _apply_bos_eos_flags(self) -> None:
        """The tokenizer.json post-processor decides which special tokens ``encode`` adds, as in
        transformers 5 (which drops ``add_bos_token``/``add_eos_token`` when tokenizer.json exists).
        Only when the json has no post-processor are the flags used, as transformers 4's Llama
        tokenizers did, so a checkpoint that asks for ``<s>`` that way still gets it."""
        if self._tok.post_processor is not None:
            return
        bos = _token_str(self.config.get("bos_token"))
        eos = _token_str(self.config.get("eos_token"))
        bos_id, eos_id = self._id_of(bos), self._id_of(eos)
        add_bos = bool(self.config.get("add_bos_token", False)) and bos_id is not None
        add_eos = bool(self.config.get("add_eos_token", False)) and eos_id is not None
        if not (add_bos or add_eos):
            return
        single = f"{bos + ':0 ' if add_bos else ''}$A:0{' ' + eos + ':0' if add_eos else ''}"
        pair = f"{single}{' ' + bos + ':1' if add_bos else ''} $B:1{' ' + eos + ':1' if add_eos else ''}"
        special = ([(bos, bos_id)] if add_bos else []) + ([(eos, eos_id)] if add_eos else [])
        self._tok.post_processor = processors.TemplateProcessing(
            single=single, pair=pair, special_tokens=special)

    # -- API ------------------------------------------------------------------------------------
    @property
    def backend(self) -> _HFTokenizer:
        """The underlying ``tokenizers.Tokenizer``."""
        return self._tok

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer knows, added/special tokens included."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=add_special_tokens)]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Token ids to text. Ids the tokenizer does not know (padded vocab rows) decode to ''."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> Optional[int]:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> Optional[str]:
        return self._tok.id_to_token(int(token_id))

    # -- chat template (backend/text/chat_template.py renders it in a jinja2 sandbox) -----------------
    @property
    def chat_template(self) -> Optional[str]:
        """The checkpoint's chat template (tokenizer_config.json), or None."""
        template = self.config.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        return template if isinstance(template, str) and template else None

    def render_chat(self, messages: Sequence[dict], add_generation_prompt: bool = True,
                    **variables: Any) -> str:
        """The prompt text for ``messages`` ([{"role", "content"}, ...]) by the chat template.

        Encode the result with ``add_special_tokens=False``: the template writes its own markers.
        Raises ``ChatTemplateError`` (a ValueError) when there is no template or it fails."""
        from backend.text.chat_template import ChatTemplateError, render_chat_template

        if self.chat_template is None:
            raise ChatTemplateError(f"the tokenizer at {self.name_or_path} has no chat template")
        special = {k: _token_str(self.config.get(k)) for k in _SPECIAL_KEYS}
        return render_chat_template(self.chat_template, messages, add_generation_prompt,
                                    special_tokens=special, **variables)

    def __repr__(self) -> str:
        return (f"Tokenizer({self.name_or_path!r}, vocab_size={self.vocab_size}, "
                f"bos={self.bos_token_id}, eos={self.eos_token_id})")


def max_input_bytes(tokenizer: Optional["Tokenizer"], max_model_len: int) -> int:
    """4 x max_model_len x the longest token in bytes: each token covers at most that many bytes of
    text, so a longer text cannot fit in max_model_len tokens (x4 leaves room for normalizers
    that shrink text). It lets a 10 MB prompt be refused before it is tokenized."""
    vocab = tokenizer.backend.get_vocab(with_added_tokens=True) if tokenizer is not None else {}
    longest = max((len(t.encode("utf-8")) for t in vocab), default=16)
    return 4 * max_model_len * max(longest, 1)
