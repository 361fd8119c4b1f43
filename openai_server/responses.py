"""Triton responses -> OpenAI JSON: one `Piece` per Triton response, added up per choice into
`ChoiceState`, and the completion / chat bodies and SSE chunks built from them. No I/O here.

The `logprobs` output follows the vLLM backend's additional-outputs contract: per response, a JSON
list with one object per new token, {token_id: {"logprob", "rank", "decoded_token"}}, the sampled
token included.

With a reasoning parser (`--reasoning-parser`, reasoning.py), a chat answer's thinking goes to the
message's (and each delta's) `reasoning` and `reasoning_content`, the rest on. With tools
(tools.py), the answer is read for tool calls in the server's format (tool_parsers.py): the message
gets OpenAI's `tool_calls`, and a stream sends `delta.tool_calls` (the call's id and name first,
then its `arguments` piece by piece); finish_reason is "tool_calls" when calls were made, except
for a named tool_choice ("stop", as OpenAI). One parser (parse.OutputParser) reads both, streamed
or whole, so the stream adds up to the whole answer.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional

import numpy as np

from templates.tensors import QUEUE_INFO_OUTPUTS
from openai_server.parse import OutputParser, schemas_of
from openai_server.reasoning import with_reasoning
from openai_server.tool_parsers import delta_calls, openai_calls

if TYPE_CHECKING:
    from openai_server.reasoning_request import Thinking
    from openai_server.tools import ToolCalling

# Engine reasons OpenAI has no word for are passed through (abort: the server stopped the request).
FINISH_REASONS = {"stop": "stop", "length": "length"}


@dataclass
class TokenLogprob:
    token_id: int
    logprob: Optional[float]  # None: an echoed prompt's first token (nothing comes before it)
    text: str
    top: Optional[list[tuple[int, float, str]]]  # (token id, logprob, text), best first


@dataclass
class Piece:
    """What one Triton response holds for one completion: its new text and tokens (streaming; the
    whole answer otherwise), and its finish reason once it ended."""
    text: str = ""
    num_tokens: int = 0
    finish_reason: Optional[str] = None
    num_input_tokens: Optional[int] = None
    num_cached_tokens: Optional[int] = None  # prompt tokens served from the prefix cache or a KV tier
    logprobs: Optional[list[TokenLogprob]] = None
    queue_info: Optional[dict[str, Any]] = None  # return_queue_info's outputs, by name
    prompt_logprobs: Optional[list] = None  # vLLM's prompt_logprobs (the prompt's, on each of its choices)


def pieces(get: Callable[[str], Optional[np.ndarray]], top_k: Optional[int]) -> list[Piece]:
    """One Triton response -> one Piece per completion. As the vLLM backend lays it out, each output
    has one entry per completion (n of them); output_ids is sent only for n = 1; finish_reason is
    the string "None" while a completion runs; num_output_tokens counts this response's tokens.
    `get(name)` is the numpy array of an output, or None when the response lacks it."""
    texts, ids, reasons, n_in, n_out, lps, n_cached = (get(n) for n in (
        "text_output", "output_ids", "finish_reason", "num_input_tokens", "num_output_tokens", "logprobs",
        "num_cached_tokens"))
    texts = [_str(v) for v in texts.reshape(-1)] if texts is not None else [""]
    n = len(texts)
    prompt_tokens = int(n_in.reshape(-1)[0]) if n_in is not None and n_in.size else None
    cached_tokens = int(n_cached.reshape(-1)[0]) if n_cached is not None and n_cached.size else None
    queue_info = _queue_info(get)
    prompt_lps = get("prompt_logprobs")
    prompt_lps = json.loads(_str(prompt_lps.reshape(-1)[0])) if prompt_lps is not None and prompt_lps.size else None
    out = []
    for i in range(n):
        reason = _str(reasons.reshape(-1)[i]) if reasons is not None and reasons.size > i else ""
        token_ids = [int(t) for t in ids.reshape(-1)] if ids is not None and n == 1 else None
        count = (int(n_out.reshape(-1)[i]) if n_out is not None and n_out.size > i
                 else len(token_ids) if token_ids is not None else 0)
        piece = Piece(text=texts[i], num_tokens=count,
                      finish_reason=None if reason in ("", "None") else reason,
                      num_input_tokens=prompt_tokens, num_cached_tokens=cached_tokens)
        if top_k is not None and lps is not None and lps.size > i and token_ids is not None:
            piece.logprobs = parse_logprobs(_str(lps.reshape(-1)[i]), token_ids, top_k)
        piece.queue_info, piece.prompt_logprobs = queue_info, prompt_lps
        out.append(piece)
    return out


def _queue_info(get: Callable[[str], Optional[np.ndarray]]) -> Optional[dict[str, Any]]:
    """The return_queue_info outputs of a response (the request's, so every choice shows them)."""
    found = {name: get(name) for name in QUEUE_INFO_OUTPUTS}
    if all(v is None for v in found.values()):
        return None
    return {k: v.reshape(-1)[0].item() for k, v in found.items() if v is not None and v.size}


def parse_logprobs(raw: str, token_ids: list[int], top_k: int) -> list[TokenLogprob]:
    """The `logprobs` entry of one response -> one TokenLogprob per new token. Each token's object
    holds the top k by rank and the sampled token (vLLM); which one was sampled is told by
    output_ids, which the model sends for n = 1 only (so logprobs need n = 1: translate.py)."""
    entries = json.loads(raw) if raw and raw != "null" else []
    out = []
    for token_id, entry in zip(token_ids, entries):
        ranked = sorted(((int(k), v) for k, v in entry.items()), key=lambda kv: kv[1].get("rank", 0))
        sampled = entry.get(str(token_id), {"logprob": float("-inf"), "decoded_token": ""})
        top = [(t, float(v["logprob"]), v.get("decoded_token") or "") for t, v in ranked[:top_k]]
        out.append(TokenLogprob(token_id, float(sampled["logprob"]), sampled.get("decoded_token") or "", top))
    return out


def _str(value: Any) -> str:
    return value.decode("utf-8", errors="replace") if isinstance(value, (bytes, np.bytes_)) else str(value)


@dataclass
class ChoiceState:
    """One choice added up over its pieces."""
    text: str = ""
    num_output_tokens: int = 0
    num_input_tokens: int = 0
    num_cached_tokens: Optional[int] = None  # None: the model does not report it
    finish_reason: Optional[str] = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    queue_info: Optional[dict[str, Any]] = None  # the newest
    prompt_logprobs: Optional[list] = None

    def add(self, piece: Piece) -> bool:
        """Take one response's piece; True when it ends the choice. With n > 1 a finished
        completion keeps its reason in the responses that follow: those pieces are ignored."""
        if self.finish_reason is not None:
            return False
        self.text += piece.text
        self.num_output_tokens += piece.num_tokens
        if piece.num_input_tokens is not None:
            self.num_input_tokens = piece.num_input_tokens
        if piece.num_cached_tokens is not None:
            self.num_cached_tokens = piece.num_cached_tokens
        if piece.logprobs:
            self.logprobs.extend(piece.logprobs)
        if piece.queue_info is not None:
            self.queue_info = piece.queue_info
        if piece.prompt_logprobs is not None:
            self.prompt_logprobs = piece.prompt_logprobs
        if piece.finish_reason:
            self.finish_reason = FINISH_REASONS.get(piece.finish_reason, piece.finish_reason)
            return True
        return False


def usage(choices: list[ChoiceState], n: int) -> dict[str, Any]:
    """Prompt tokens count once per prompt (every n-th choice), as OpenAI counts them; so do the
    cached ones (`prompt_tokens_details.cached_tokens`: served from the prefix cache or a KV tier),
    shown when the model reports them."""
    prompt = sum(c.num_input_tokens for c in choices[::n])
    completion = sum(c.num_output_tokens for c in choices)
    out: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    cached = [c.num_cached_tokens for c in choices[::n] if c.num_cached_tokens is not None]
    if cached:
        out["prompt_tokens_details"] = {"cached_tokens": sum(cached)}
    return out


# -- logprobs in OpenAI's two shapes -----------------------------------------------------------------

def chat_logprobs(tokens: list[TokenLogprob]) -> dict[str, Any]:
    def item(text: str, logprob: float) -> dict[str, Any]:
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}
    return {"content": [{**item(t.text, t.logprob), "top_logprobs": [item(s, lp) for _, lp, s in t.top]}
                        for t in tokens]}


def completion_logprobs(tokens: list[TokenLogprob], offset: int = 0) -> dict[str, Any]:
    offsets, at = [], offset
    for t in tokens:
        offsets.append(at)
        at += len(t.text)
    return {"tokens": [t.text for t in tokens], "token_logprobs": [t.logprob for t in tokens],
            "top_logprobs": [None if t.top is None else {s: lp for _, lp, s in t.top} for t in tokens],
            "text_offset": offsets}


# -- bodies ------------------------------------------------------------------------------------------

@dataclass
class Reply:
    """What every body and chunk of one call shares."""
    id: str
    model: str
    chat: bool
    created: int = field(default_factory=lambda: int(time.time()))
    tools: Optional["ToolCalling"] = None
    thinking: Optional["Thinking"] = None  # the reasoning parser and the prompt's thinking state
    _parsers: dict[int, OutputParser] = field(default_factory=dict)  # streaming: one per choice

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def body(self, choices: list[ChoiceState], n: int, want_logprobs: bool,
             prefixes: Optional[list[str]] = None, echoed: Optional[list[list[TokenLogprob]]] = None) -> dict[str, Any]:
        """The non-streaming answer (prefixes: the echoed prompts; echoed: their tokens' logprobs,
        echo_logprobs.py)."""
        out = []
        for i, c in enumerate(choices):
            if self.chat:
                message, calls = self._message(c.text)
                out.append({"index": i, "message": message,
                            "logprobs": chat_logprobs(c.logprobs) if want_logprobs else None,
                            "finish_reason": self._finish_reason(c.finish_reason, calls)})
            else:
                prefix = prefixes[i] if prefixes else ""
                out.append({"index": i, "text": prefix + c.text,
                            "logprobs": completion_logprobs((echoed[i] if echoed else []) + c.logprobs)
                            if want_logprobs else None,
                            "finish_reason": c.finish_reason})
            if c.queue_info is not None:  # an extension field, only when asked (return_queue_info)
                out[-1]["queue_info"] = c.queue_info
            if c.prompt_logprobs is not None and not self.chat:  # vLLM's field, only when asked
                out[-1]["prompt_logprobs"] = c.prompt_logprobs
        prompt = {"prompt_logprobs": choices[0].prompt_logprobs} if self.chat and choices[0].prompt_logprobs else {}
        return {**self._head("chat.completion" if self.chat else "text_completion"), "choices": out,
                "usage": usage(choices, n), **prompt}

    def chunk(self, index: int, piece: Piece, state: ChoiceState, first: bool, want_logprobs: bool,
              include_usage: bool, prefix: str = "", echoed: Optional[list[TokenLogprob]] = None) -> dict[str, Any]:
        """One SSE chunk for one Triton response of choice `index` (`state` already holds it)."""
        reason = state.finish_reason if piece.finish_reason else None  # on the piece that ended it
        lp = piece.logprobs or []
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if first else {}
            calls = False
            if self._parser() is not None:
                calls = self._delta(index, piece, delta)
            else:
                delta["content"] = piece.text
            choice = {"index": index, "delta": delta, "logprobs": chat_logprobs(lp) if want_logprobs else None,
                      "finish_reason": self._finish_reason(reason, calls)}
        else:
            offset = len(state.text) - len(piece.text) + (0 if first else sum(len(t.text) for t in echoed or ()))
            choice = {"index": index, "text": (prefix if first else "") + piece.text,
                      "logprobs": completion_logprobs((echoed or [] if first else []) + lp, 0 if first else offset)
                      if want_logprobs else None,
                      "finish_reason": reason}
        if piece.queue_info is not None:  # an extension field, only when asked (return_queue_info)
            choice["queue_info"] = piece.queue_info
        if piece.prompt_logprobs is not None:  # vLLM's field, with the first tokens
            choice["prompt_logprobs"] = piece.prompt_logprobs
        out = {**self._head("chat.completion.chunk" if self.chat else "text_completion"), "choices": [choice]}
        if include_usage:
            out["usage"] = None  # as OpenAI: null on every chunk but the last
        return out

    # -- reasoning and tool calls ---------------------------------------------------------------------
    def _parser(self) -> Optional[OutputParser]:
        """A new parser of this call's answers, or None when there is nothing to parse."""
        reasoning = self.thinking.parser if self.thinking is not None else None
        tools = self.tools.parser if self.tools is not None and self.tools.parses else None
        if reasoning is None and tools is None:
            return None
        return OutputParser(reasoning, tools, schemas_of(self.tools.template_tools()) if tools else None,
                            self.thinking.prompt if reasoning else "none")

    def _message(self, text: str) -> tuple[dict[str, Any], bool]:
        parser = self._parser()
        if parser is None:
            return {"role": "assistant", "content": text}, False
        thought, content, _ = parser.feed(text, final=True)
        calls = openai_calls(parser.tool_calls)
        if self.tools is not None and not self.tools.parallel:
            calls = calls[:1]
        message = with_reasoning({"role": "assistant"}, thought if parser.thought and (self.thinking is None or self.thinking.include) else None)
        if not calls:
            message["content"] = content if content or parser.reasoning is None else None
            return message, False
        message.update(content=content if content.strip() else None, tool_calls=calls)
        return message, True

    def _delta(self, index: int, piece: Piece, delta: dict[str, Any]) -> bool:
        """Fill a stream chunk's delta from the parser of choice `index`; whether it has made calls."""
        parser = self._parsers.get(index) or self._parsers.setdefault(index, self._parser())
        thought, content, events = parser.feed(piece.text, final=bool(piece.finish_reason))
        calls = delta_calls(events, None if self.tools is None or self.tools.parallel else 1)
        if thought and (self.thinking is None or self.thinking.include):
            with_reasoning(delta, thought)
        if content or not (calls or thought):
            delta["content"] = content
        if calls:
            delta["tool_calls"] = calls
        return bool(parser.tool_calls)

    def _finish_reason(self, reason: Optional[str], calls: bool) -> Optional[str]:
        if reason == "stop" and calls and self.tools is not None and not self.tools.named:
            return "tool_calls"
        return reason

    def usage_chunk(self, choices: list[ChoiceState], n: int) -> dict[str, Any]:
        return {**self._head("chat.completion.chunk" if self.chat else "text_completion"), "choices": [],
                "usage": usage(choices, n)}


def sse(data: dict[str, Any] | str) -> bytes:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n".encode("utf-8")
