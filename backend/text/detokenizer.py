"""Streaming detokenization: generated token ids to text deltas.

``IncrementalDetokenizer`` turns a stream of generated token ids into text deltas, the way vLLM and
TGI do: each step decodes a short window that starts a few tokens before the new ones, and keeps the
part past the window's already-emitted prefix. That keeps leading spaces right for SentencePiece
("▁"/Metaspace) tokenizers, whose decoders strip the space of the first token they see, and it
holds text back while it ends in U+FFFD (a multi-byte character split across tokens), so every delta
is valid text.
"""
from __future__ import annotations

from typing import Iterable, Optional, Sequence

from backend.text.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"


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
                 skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # vLLM's spaces_between_special_tokens=False: added tokens' texts and the text between them
        # are joined with nothing (what a slow HF tokenizer's decode does with it); moot when they
        # are skipped
        self._added: dict[int, str] = {} if skip_special_tokens or spaces_between_special_tokens else {
            i: t.content for i, t in tokenizer.backend.get_added_tokens_decoder().items()}
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
        if self._added:
            return decode_joined(self.tokenizer, ids, self._added)
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


def decode_joined(tokenizer: Tokenizer, ids: Sequence[int], added: dict[int, str]) -> str:
    """Token ids to text with nothing between added tokens and their neighbours: each added token's
    own text, each run of other tokens decoded alone (spaces_between_special_tokens=False)."""
    parts, run = [], []
    for t in ids:
        if t in added:
            if run:
                parts.append(tokenizer.decode(run, skip_special_tokens=False))
                run = []
            parts.append(added[t])
        else:
            run.append(t)
    if run:
        parts.append(tokenizer.decode(run, skip_special_tokens=False))
    return "".join(parts)
