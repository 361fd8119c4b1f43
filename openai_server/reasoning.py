"""A reasoning model's thinking split from its answer: the formats `--reasoning-parser` names (vLLM's).

- `qwen3`: `<think>…</think>` opens the output when the model thinks (Qwen3's chat template writes an
  empty `<think>\\n\\n</think>\\n\\n` itself when `enable_thinking` is false, and the model answers
  directly); an output that does not open with `<think>` is all answer;
- `deepseek_r1`: the output starts inside the thinking, whether or not it writes `<think>` itself
  (DeepSeek-R1's template ends the prompt with `<think>\\n`): everything up to `</think>` is thinking.
For both, a prompt that ends inside a think block (`opened`: Qwen3-Thinking-2507, R1) starts the
output inside it. An output cut short inside its thinking (`length`) is all reasoning, streamed or
not (vLLM's qwen3 calls it content when whole and reasoning when streamed). The newlines right after
`</think>` separate the two parts and belong to neither (Qwen3's own template drops them).

`ReasoningParser.feed(text)` returns (reasoning, content) deltas as the text arrives, holding back
what may still be part of a tag, so that no tag and no piece of one reaches either field; the whole
answer is `feed(all)` then `finish()`, the same machine, so streamed pieces always join to it.
"""
from __future__ import annotations

from typing import Any, Optional

PARSERS = ("qwen3", "deepseek_r1")
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
# The message and delta fields: vLLM documents `reasoning`; `reasoning_content` is its older name,
# which clients written for DeepSeek's API read. Both are sent.
FIELDS = ("reasoning", "reasoning_content")


def held_back(text: str, *markers: str) -> int:
    """The length of the longest end of `text` that is the start (not the whole) of a marker."""
    best = 0
    for marker in markers:
        for k in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:k]):
                best = k
                break
    return best


def prompt_state(prompt_text: str) -> str:
    """Where the rendered prompt leaves the thinking: "open" (it ends inside a think block), "closed"
    (it ends right after one: thinking turned off) or "none"."""
    tail = prompt_text.rstrip()
    if tail.endswith(THINK_OPEN):
        return "open"
    if tail.endswith(THINK_CLOSE):
        return "closed"
    return "none"


class ReasoningParser:
    def __init__(self, fmt: str, prompt: str = "none"):
        if fmt not in PARSERS:
            raise ValueError(f"reasoning parser: one of {', '.join(PARSERS)}; got {fmt!r}")
        self.fmt = fmt
        # "start": the output's opening decides; "think"; "after": just past </think>; "content"
        if prompt == "closed":
            self.mode = "content"
        elif prompt == "open" or fmt == "deepseek_r1":
            self.mode = "start_thinking"  # inside the thinking; a <think> written again is dropped
        else:
            self.mode = "start"
        self.buffer = ""
        self.thought = False  # a think block was seen (the message then has a reasoning field)

    def feed(self, text: str) -> tuple[str, str]:
        self.buffer += text
        reasoning, content = [], []
        while self._step(reasoning, content, final=False):
            pass
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        reasoning, content = [], []
        while self._step(reasoning, content, final=True):
            pass
        return "".join(reasoning), "".join(content)

    def _step(self, reasoning: list, content: list, final: bool) -> bool:
        buf = self.buffer
        if self.mode in ("start", "start_thinking"):
            stripped = buf.lstrip()
            if stripped.startswith(THINK_OPEN):
                self.buffer, self.mode, self.thought = stripped[len(THINK_OPEN):], "think", True
                return True
            if not final and (not stripped or THINK_OPEN.startswith(stripped)):
                return False  # it may still open with <think>
            self.mode = "think" if self.mode == "start_thinking" else "content"
            self.thought = self.thought or self.mode == "think"
            return True
        if self.mode == "think":
            end = buf.find(THINK_CLOSE)
            if end >= 0:
                reasoning.append(buf[:end])
                self.buffer, self.mode = buf[end + len(THINK_CLOSE):], "after"
                return True
            keep = 0 if final else held_back(buf, THINK_CLOSE)
            reasoning.append(buf[:len(buf) - keep])
            self.buffer = buf[len(buf) - keep:]
            return False
        if self.mode == "after":
            rest = buf.lstrip("\n")
            if not rest and not final:
                return False
            self.buffer, self.mode = rest, "content"
            return True
        content.append(buf)
        self.buffer = ""
        return False


def split_reasoning(text: str, fmt: str, prompt: str = "none") -> tuple[Optional[str], Optional[str]]:
    """A whole answer -> (its reasoning, None when it has no think block; its content, None when
    empty)."""
    parser = ReasoningParser(fmt, prompt)
    r1, c1 = parser.feed(text)
    r2, c2 = parser.finish()
    reasoning, content = r1 + r2, c1 + c2
    return (reasoning if parser.thought else None), (content or None)


def with_reasoning(message: dict[str, Any], reasoning: Optional[str]) -> dict[str, Any]:
    """The message or delta with its reasoning under both field names (when there is any)."""
    if reasoning is not None:
        for name in FIELDS:
            message[name] = reasoning
    return message

