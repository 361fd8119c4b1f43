"""What the engine hands back per request and step, and stop-string handling on the text stream."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    new_token_ids: list[int]  # generated this step
    token_ids: list[int]  # every generated token so far
    new_text: str  # text released this step
    text: str  # every released character so far
    finished: bool
    finish_reason: Optional[str]  # stop | length | abort | error, once finished
    error: Optional[str] = None


def merge_outputs(first: Optional[RequestOutput], then: RequestOutput) -> RequestOutput:
    """One output that carries `first`'s new tokens and text followed by `then`'s, and `then`'s
    totals and state (finished, finish_reason, error): outputs held back, then sent as one.
    With no `first`, `then` itself."""
    if first is None:
        return then
    return dataclasses.replace(then, new_token_ids=list(first.new_token_ids) + list(then.new_token_ids),
                               new_text=first.new_text + then.new_text)


class StopStringMatcher:
    """Accumulates the detokenized stream, ends it at the first stop string (which is not part of
    the output, as in vLLM), and holds back just enough characters that a stop string arriving
    split over several steps is never partly streamed."""

    def __init__(self, stops: list[str]):
        self.stops = list(stops)
        self.holdback = max((len(s) for s in self.stops), default=1) - 1
        self.text = ""
        self.emitted = ""
        self.stopped = False

    def feed(self, delta: str) -> bool:
        """Add text; True when a stop string completed within it."""
        if self.stopped or not delta:
            return False
        search_from = max(0, len(self.text) - self.holdback)
        self.text += delta
        hits = [i for s in self.stops if (i := self.text.find(s, search_from)) >= 0]
        if hits:
            self.text = self.text[:min(hits)]
            self.stopped = True
        return self.stopped

    def emit(self, final: bool) -> str:
        """The text that may be released now."""
        end = len(self.text) if final or self.stopped else max(len(self.emitted), len(self.text) - self.holdback)
        new = self.text[len(self.emitted):end]
        self.emitted += new
        return new
