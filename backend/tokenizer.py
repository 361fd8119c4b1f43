"""Tokenization for the engine: a thin layer over the ``tokenizers`` library, and streaming detok.

``Tokenizer`` loads a checkpoint's ``tokenizer.json`` (+ ``tokenizer_config.json``) and encodes the
way ``transformers.AutoTokenizer(...)(text)["input_ids"]`` does for Llama / Mistral / Qwen2-style
checkpoints, without importing transformers:

- the ``tokenizer.json`` post-processor adds the special tokens (e.g. Llama's ``<s>``); as in
  transformers 5 it is authoritative, and ``tokenizer_config.json``'s ``add_bos_token`` /
  ``add_eos_token`` only matter for a tokenizer.json without a post-processor;
- the special tokens named in ``tokenizer_config.json`` are registered as special added tokens, so
  they are matched whole in the text and skipped by ``decode(..., skip_special_tokens=True)``.

``IncrementalDetokenizer`` turns a stream of generated token ids into text deltas, the way vLLM and
TGI do: each step decodes a short window that starts a few tokens before the new ones, and keeps the
part past the window's already-emitted prefix. That keeps leading spaces right for SentencePiece
("▁"/Metaspace) tokenizers, whose decoders strip the space of the first token they see, and it
holds text back while it ends in U+FFFD (a multi-byte character split across tokens), so every delta
is valid text.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence, Union

from tokenizers import AddedToken, processors
from tokenizers import Tokenizer as _HFTokenizer

__all__ = ["Tokenizer", "IncrementalDetokenizer"]

_REPLACEMENT = "\ufffd"
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

    # -- chat template (backend/chat_template.py renders it in a jinja2 sandbox) -----------------
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
        from backend.chat_template import ChatTemplateError, render_chat_template

        if self.chat_template is None:
            raise ChatTemplateError(f"the tokenizer at {self.name_or_path} has no chat template")
        special = {k: _token_str(self.config.get(k)) for k in _SPECIAL_KEYS}
        return render_chat_template(self.chat_template, messages, add_generation_prompt,
                                    special_tokens=special, **variables)

    def __repr__(self) -> str:
        return (f"Tokenizer({self.name_or_path!r}, vocab_size={self.vocab_size}, "
                f"bos={self.bos_token_id}, eos={self.eos_token_id})")


class IncrementalDetokenizer:
    """Streams the text of one request's generated tokens.

    ``add(new_ids)`` returns the newly finalized text; ``flush()`` returns whatever was held back
    (call it when the request finishes); ``text`` is all the output text emitted so far.

    Each step decodes the window ``ids[prefix_offset:]`` and emits what lies past the decoded
    ``ids[prefix_offset:read_offset]`` (the context that was already emitted). The window starts
    with up to ``context_tokens`` prompt tokens, so the first output token's leading space survives
    for tokenizers whose decoder strips the first token's space. Text is held back while the
    decoded window ends in U+FFFD, i.e. while a multi-byte character is still incomplete.

    Invariant: ``text`` after ``flush()`` equals
    ``decode(prompt + output)[len(decode(prompt)):]`` (with ``skip_special_tokens``), which is
    ``decode(output)`` for byte-level BPE tokenizers and for SentencePiece-style ones when the prompt
    decodes to no text (e.g. only ``<s>``). With a text prompt, a "▁" tokenizer's first output
    delta keeps its leading space, which ``decode(output)`` alone would strip. (Two caveats, both
    about invalid UTF-8 only: a prompt that ends inside a character loses that character, and a
    byte-fallback decoder, which turns a whole run of byte tokens into U+FFFD once any byte in it is
    invalid, can differ from the full decode in how many U+FFFD it shows.)
    """

    context_tokens = 5  # prompt tokens of context, as vLLM (INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET)
    max_hold_tokens = 16  # a tail still ending in U+FFFD after this many tokens is invalid bytes

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int] = (),
                 skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        prompt = [int(t) for t in prompt_token_ids]
        self._ids: list[int] = prompt[self._context_start(prompt):]
        self._num_output = 0
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._prefix_text: Optional[str] = None  # decode(ids[prefix_offset:read_offset]), cached
        self._chunks: list[str] = []

    def _context_start(self, prompt: list[int]) -> int:
        """Where the context window starts: ``context_tokens`` back, moved to a character boundary.

        A window that starts inside a character decodes that character's tail as U+FFFD, and a
        byte-fallback decoder turns the whole run of byte tokens into U+FFFD, which would then spill
        into the first output token's text."""
        n = len(prompt)
        start = max(n - self.context_tokens, 0)
        if start == 0:
            return 0
        for s in [*range(start, max(start - 8, 0) - 1, -1), *range(start + 1, n)]:
            if not self._decode(prompt[s:]).startswith(_REPLACEMENT):
                return s
        return start

    @property
    def text(self) -> str:
        """All output text emitted so far (the concatenation of every delta)."""
        if len(self._chunks) > 1:
            self._chunks = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    @property
    def num_output_tokens(self) -> int:
        return self._num_output

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _emit(self, final: bool) -> str:
        ids = self._ids
        if self._read_offset == len(ids):
            return ""
        if self._prefix_text is None:
            self._prefix_text = self._decode(ids[self._prefix_offset:self._read_offset])
        prefix_text = self._prefix_text
        new_text = self._decode(ids[self._prefix_offset:])
        end = len(ids)
        if not final and new_text.endswith(_REPLACEMENT):
            if end - self._read_offset < self.max_hold_tokens:
                return ""  # an incomplete character: wait for its remaining bytes
            # Still U+FFFD after many tokens: invalid bytes (a random model's output), not a split
            # character. Emit all but the last 4 tokens (>= 3 bytes, the most an incomplete
            # character can still need), if what they decode to is final.
            end -= 4
            cut_text = self._decode(ids[self._prefix_offset:end])
            if not new_text.startswith(cut_text):
                return ""
            new_text = cut_text
        if len(new_text) <= len(prefix_text) and not final:
            # Nothing visible yet (e.g. skipped special tokens): keep the window as it is, so the
            # next token is still decoded with the same context.
            return ""
        delta = new_text[len(prefix_text):]
        # Slide the window: the tokens just emitted become the context of the next step.
        self._prefix_offset, self._read_offset = self._read_offset, end
        self._prefix_text = None
        del ids[:self._prefix_offset]  # ids no window will look at again
        self._read_offset -= self._prefix_offset
        self._prefix_offset = 0
        if delta:
            self._chunks.append(delta)
        return delta

    def add(self, new_token_ids: Iterable[int]) -> str:
        """Append generated token ids; return the text they finalize (may be '')."""
        new = [int(t) for t in new_token_ids]
        if not new:
            return ""
        self._ids.extend(new)
        self._num_output += len(new)
        return self._emit(final=False)

    def flush(self) -> str:
        """Return any held-back tail (call once the request has finished)."""
        return self._emit(final=True)
