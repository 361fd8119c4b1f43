"""Requests and their lifecycle: a `Request` is one sequence as the scheduler holds it (its tokens,
how many have KV in the cache, its state). Its settings are `SamplingParams` (sampling_params.py).
No torch here.
"""
from __future__ import annotations

import enum
import time
from typing import Optional

from backend.core.sampling_params import SamplingParams
from backend.core.tokens import TokenSequence


def seq_id_of(request_id: str, index: int) -> str:
    """The id of a request's index-th completion: the request id itself for the first."""
    return request_id if index == 0 else f"{request_id}#{index}"


class RequestStatus(enum.Enum):
    WAITING_FOR_GRAMMAR = "waiting_for_grammar"  # its constraint compiles; not in the scheduler yet
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        return self not in (RequestStatus.WAITING, RequestStatus.RUNNING, RequestStatus.WAITING_FOR_GRAMMAR)


class Request(TokenSequence):
    """One sequence: its tokens, how many of them have KV in the cache, and its state.

    A request with n > 1 completions is n sequences: `index` tells them apart and `seq_id` names
    each (the first keeps the request id); the others fork the first's prompt blocks."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 eos_token_ids: tuple[int, ...] = (), arrival_time: Optional[float] = None,
                 seed: int = 0, priority: int = 0, index: int = 0):
        self.request_id = request_id
        self.index = index
        self.seq_id = seq_id_of(request_id, index)
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.priority = priority  # lower runs first
        self.arrival_seq: Optional[int] = None  # the waiting queue's arrival number, kept across preemption
        self.admitted_time: Optional[float] = None  # when it first started running
        self.first_scheduled_step: Optional[int] = None  # the engine step it first ran
        self.finished_time: Optional[float] = None
        self.reports_queue = False  # the caller asked where it stands (QueueInfo on its outputs)
        self.eos_token_ids = () if params.ignore_eos else tuple(eos_token_ids)
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0  # tokens whose KV is in the cache
        self.status = RequestStatus.WAITING
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.first_token_time: Optional[float] = None
        self.num_preemptions = 0
        self.error: Optional[str] = None
        # Set when the request itself is refused after arrival (its constraint does not compile):
        # "invalid" (the client must change it: a 400) or "unavailable" (retry later); None otherwise.
        self.error_kind: Optional[str] = None
        self.stop_token_id: Optional[int] = None  # the EOS or stop token that ended it (never in its text)
        # (tokens hashed, their full blocks' prefix-cache keys): kept while it waits (admission.py)
        self.prefix_hashes: Optional[tuple[int, list[bytes]]] = None
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache or a KV tier (vLLM's)
        self.kv_load = None  # its prefix on its way back from a KV tier (backend/kv/tiers/plan.KVLoad)
        # a later beam of a search, started with its first (backend/sched/admission.py) and holding
        # nothing until the first has computed the prompt it forks
        self.parked = False
        # The seed of its random stream (`sampling_stream`), which the worker keeps with the sequence.
        self.seed = seed
        self.bad_words_ids: list[list[int]] = []  # set by the engine, which has the tokenizer
        self.logprobs: Optional[list[dict]] = [] if params.logprobs is not None else None
        self.cumulative_logprob: Optional[float] = 0.0 if params.logprobs is not None else None
        self.grammar = None  # structured outputs: its GrammarState (backend/sched/grammar.py), set by the engine
        self.pending_grammar = None  # the Future of its constraint's compile until the engine attaches it
        # LoRA (docs/lora.md), set by the engine: the adapter it runs with (None: the base model) and
        # the root of its prefix-cache keys (the adapter's; b"" for the base model)
        self.lora_name: Optional[str] = None
        self.cache_salt = b""
        # A pooling request (docs/pooling.md), set by the engine: its pooling type (last | mean | cls;
        # None: it generates), its PoolingParams, and the worker's pooled output once computed
        self.pooling: Optional[str] = None
        self.pooling_params = None
        self.pooled: Optional[list[float]] = None
        # Its images (backend/core/multimodal.py ImageItem, docs/vision.md), set by the engine: their
        # placeholder runs in the prompt, pixels and hashes (the prefix cache keys them by hash)
        self.mm_items: list = []

    @property
    def computes_whole_prompt(self) -> bool:
        """Every prompt token is computed, none taken from the prefix cache: prompt logprobs (as vLLM),
        and mean or first-token pooling, which need every token's hidden state."""
        return self.params.prompt_logprobs is not None or self.pooling in ("mean", "cls")

    @property
    def max_total_tokens(self) -> int:
        """Prompt plus every token it may still generate."""
        return self.num_prompt_tokens + self.params.max_tokens

    @property
    def max_kv_tokens(self) -> int:
        """Tokens whose KV it may ever store: the last sampled token is never fed back."""
        return self.max_total_tokens - 1

    @property
    def finish_reason(self) -> Optional[str]:
        return self.status.value if self.status.finished else None

    def __repr__(self) -> str:
        return (f"Request({self.seq_id!r}, prompt={self.num_prompt_tokens}, "
                f"out={len(self.output_token_ids)}, computed={self.num_computed_tokens}, {self.status.value})")
