"""What the Frontend (adapter.py) keeps of each request in flight and of each queued output, and the
callables Triton specifics come in through. Free of Triton imports."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional


@dataclass
class Live:
    """One request in flight: what the responder needs to answer it."""
    key: str  # the engine's request id (unique)
    client_id: str  # Triton's request id, as the client set it ('' if none)
    sender: Any
    stream: bool
    exclude_input: bool
    prompt_text: Optional[str]  # the text prompt, echoed in a non-streaming answer
    arrival: float
    n: int = 1  # completions; the engine sends one output per completion, each with its index
    returns: frozenset = frozenset()  # the return_* flags the request set: the outputs it gets
    reasoning: Optional[str] = None  # reasoning_parser: the thinking goes to reasoning_output
    beams: bool = False  # beam search: output_ids [beams, tokens] (TensorRT-LLM's beam dimension)
    last_token_time: Optional[float] = None
    last_cancel_check: float = 0.0
    cancelled: bool = False
    done: bool = False
    # Its newest outputs still waiting for the responder, which later ones may be merged into, and
    # outputs held back by completion index (non-streaming: until every completion ends;
    # stream_interval > 1: until they carry enough tokens). Guarded by Frontend._pending_lock.
    waiting: Optional["_Entry"] = None
    backlog: int = 0  # its entries queued for the responder and not yet taken
    held: dict = field(default_factory=dict)
    unfinished: int = 1  # completions whose last output has not arrived yet
    answered: bool = False  # an output with tokens has been queued
    # Responder thread only: per completion, its newest output and the tokens handled so far.
    latest: dict = field(default_factory=dict)
    tokens_seen: dict = field(default_factory=dict)
    splitters: dict = field(default_factory=dict)  # streaming, per completion: its ReasoningParser


class _Entry:
    """Queued engine outputs by completion index (each possibly several merged): when the first and
    the last merged output arrived, and whether the responder has taken it."""
    __slots__ = ("live", "outs", "t_first", "t_last", "taken")

    def __init__(self, live: Live, outs: dict, t: float):
        self.live, self.outs, self.t_first, self.t_last, self.taken = live, outs, t, t, False


Respond = Callable[[Any, Optional[dict], Optional[str], bool], None]


class NullMetrics:
    def observe(self, kind: str, seconds: float) -> None:
        pass

    def update(self, stats: Mapping[str, float]) -> None:
        pass
