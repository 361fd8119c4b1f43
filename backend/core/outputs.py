"""What the engine hands back per request and step: `CoreOutput` (tokens, from the engine thread)
and `RequestOutput` (text, built from them on the delivery side by backend/engine/output_processor.py),
and stop-string handling on the text stream."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Union


@dataclass
class Logprob:
    """One candidate token's log-probability (log_softmax of the raw logits), its rank among the
    vocabulary (1 = most likely) and its text, as vLLM reports them."""
    logprob: float
    rank: int
    decoded_token: str


# Per generated token: candidate token id -> Logprob (the sampled token and the top k).
TokenLogprobs = dict[int, Logprob]


@dataclass
class QueueInfo:
    """Where a request stands, for a caller that asked (`return_queue_info`): while it waits, its
    place and the engine step its start is reserved for; once it runs, the KV blocks reserved for
    it; and its times (time.monotonic() seconds, None until they happen), as TensorRT-LLM's
    per-request timing metrics and vLLM's RequestMetrics name them."""
    engine_step: int  # the engine step (schedule() call) this reflects; reserved_step counts the same
    position: int  # 0: the next to start (most urgent first); -1 once it has started
    reserved_step: Optional[int]  # guaranteed_no_evict with backfill: it starts at or before this step
    first_scheduled_step: Optional[int]  # the step it first ran
    kv_blocks_reserved: int  # blocks reserved for it to completion once it runs (max_utilization: held)
    arrival_time: float
    first_scheduled_time: Optional[float]
    first_token_time: Optional[float]
    finished_time: Optional[float]
    # while it waits: the expected seconds until it starts, as of engine_step (backend/sched/drain.py;
    # None before the engine has measured a step); 0 once it has started
    expected_wait_seconds: Optional[float] = None


@dataclass
class CoreOutput:
    """One sequence's news of one engine step, as the engine thread makes it: tokens and numbers,
    no text (detokenizing, stop strings and logprob texts are the delivery side's)."""
    request_id: str
    index: int = 0  # which of the request's n completions
    new_token_ids: list[int] = dataclasses.field(default_factory=list)
    # per new token, when the request asked for logprobs: (logprob, rank, top [(token, logprob)])
    new_logprobs: Optional[list[tuple[float, int, list]]] = None
    finish_reason: Optional[str] = None  # stop | length | abort | error once finished
    stop_token_id: Optional[int] = None  # the EOS or stop token that ended it (never in its text)
    error: Optional[str] = None
    error_kind: Optional[str] = None  # "invalid" | "unavailable": the whole request refused after arrival
    num_cached_tokens: int = 0
    queue_seconds: Optional[float] = None  # on its first output: arrival to first scheduled
    queue: Optional[QueueInfo] = None  # only for a request added with queue_info=True
    # with its first token, when it asked for prompt_logprobs: (logprob, rank, top) per prompt position 1..
    prompt_logprobs: Optional[list[tuple[float, int, list]]] = None
    pooled: Optional[list[float]] = None  # a pooling request's vector, as the worker gave it (docs/pooling.md)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


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
    index: int = 0  # which of the request's n completions
    new_logprobs: Optional[list[TokenLogprobs]] = None  # one per new token; None unless asked
    logprobs: Optional[list[TokenLogprobs]] = None  # one per generated token so far
    cumulative_logprob: Optional[float] = None  # sum of the sampled tokens' logprobs
    samples: Optional[list["RequestOutput"]] = None  # LLM.generate with n > 1: all n, by index
    queue_seconds: Optional[float] = None  # on its first output: arrival to first scheduled
    queue: Optional[QueueInfo] = None  # only for a request added with queue_info=True
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache or a KV tier (vLLM's)
    # A refusal after arrival, of the whole request (every completion): "invalid" (a 400) or
    # "unavailable" (retry later); None for every other output, failed ones included.
    error_kind: Optional[str] = None
    # vLLM's prompt_logprobs, once known: None for the first prompt token, then per prompt token
    # its logprob, rank and the top k; None unless asked
    prompt_logprobs: Optional[list[Optional[TokenLogprobs]]] = None
    # a pooling request's answer (docs/pooling.md): its embedding, or its scores (a classifier's)
    pooled: Optional[list[float]] = None


Output = Union[CoreOutput, "RequestOutput"]


def merge_outputs(first: Optional[Output], then: Output) -> Output:
    """One output that carries `first`'s new tokens (and text) followed by `then`'s, and `then`'s
    totals and state (finished, finish_reason, error): outputs held back, then sent as one (a
    padded batch's CoreOutputs, a stream's RequestOutputs past its backlog). With no `first`,
    `then` itself."""
    if first is None:
        return then
    logprobs = None
    if first.new_logprobs is not None or then.new_logprobs is not None:
        logprobs = list(first.new_logprobs or []) + list(then.new_logprobs or [])
    queued = first.queue_seconds if then.queue_seconds is None else then.queue_seconds
    text = {"new_text": first.new_text + then.new_text} if isinstance(then, RequestOutput) else {}
    return dataclasses.replace(then, new_token_ids=list(first.new_token_ids) + list(then.new_token_ids),
                               new_logprobs=logprobs, queue_seconds=queued, queue=then.queue or first.queue,
                               prompt_logprobs=then.prompt_logprobs or first.prompt_logprobs, **text)


class StopStringMatcher:
    """Accumulates the detokenized stream, ends it at the first stop string (which is not part of
    the output, as in vLLM, unless `include`: include_stop_str_in_output), and holds back just
    enough characters that a stop string arriving split over several steps is never partly streamed
    (nothing with `include`, as vLLM: the stop string is output either way)."""

    def __init__(self, stops: list[str], include: bool = False):
        self.stops = list(stops)
        self.include = include
        self.holdback = 0 if include else max((len(s) for s in self.stops), default=1) - 1
        self._search_back = max((len(s) for s in self.stops), default=1) - 1
        self.text = ""
        self.emitted = ""
        self.stopped = False

    def feed(self, delta: str, check: bool = True) -> bool:
        """Add text; True when a stop string completed within it. With check False the text is
        only recorded (vLLM does not look for stop strings before min_tokens)."""
        if self.stopped or not delta:
            return False
        search_from = max(0, len(self.text) - self._search_back)
        self.text += delta
        if not check:
            return False
        hits = [(i, len(s)) for s in self.stops if (i := self.text.find(s, search_from)) >= 0]
        if hits:
            start, length = min(hits, key=lambda h: h[0])
            self.text = self.text[:start + length if self.include else start]
            self.stopped = True
        return self.stopped

    def emit(self, final: bool) -> str:
        """The text that may be released now."""
        end = len(self.text) if final or self.stopped else max(len(self.emitted), len(self.text) - self.holdback)
        new = self.text[len(self.emitted):end]
        self.emitted += new
        return new
