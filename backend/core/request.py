"""Requests, their sampling parameters and their lifecycle. No torch here.

`SamplingParams` is the one place a request's settings are checked: the Triton adapter, the OpenAI
server and the Python API all build one (from tensors, JSON or keywords) and its `validate` names
the field and the limit of anything out of range.
"""
from __future__ import annotations

import enum
import math
import random
import time
from dataclasses import dataclass, field, fields
from typing import Any, Mapping, Optional

from backend.core.input_guard import lone_surrogate
from backend.core.structured import LEGACY_KEYS, OBJECT_KEYS, StructuredOutputs, fold_legacy_keys

MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 256
MAX_BAD_WORDS = 64
MAX_N = 64
MAX_LOGPROBS = 20  # vLLM's default max_logprobs
GREEDY_BELOW = 1e-5  # vLLM's _SAMPLING_EPS: a lower temperature is greedy decoding


@dataclass
class SamplingParams:
    """vLLM-style sampling settings. A temperature below 1e-5 means greedy."""
    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0  # 0 or -1: off (vLLM's -1)
    top_p: float = 1.0
    seed: Optional[int] = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    n: int = 1  # completions of the same prompt (its KV computed once)
    logprobs: Optional[int] = None  # None: none; 0: the sampled token's; k: also the top k
    repetition_penalty: float = 1.0  # > 0; above 1 discourages tokens of the prompt and the output
    presence_penalty: float = 0.0  # subtracted once from every token already generated
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output
    bad_words: list[str] = field(default_factory=list)  # words that are never generated
    # JSON schema, regex, choice, grammar... (backend/structured/): compiled at arrival by the engine
    structured_outputs: Optional[StructuredOutputs] = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        if self.structured_outputs is not None:
            self.structured_outputs = StructuredOutputs.parse(self.structured_outputs)
        self.validate()

    def validate(self) -> None:
        _int_range("max_tokens", self.max_tokens, 1)
        _number("temperature", self.temperature, 0.0)
        _int_range("top_k", self.top_k, -1, hint=" (-1 or 0 disables it)")
        if not (isinstance(self.top_p, (int, float)) and math.isfinite(self.top_p) and 0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1]; got {self.top_p}")
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens={self.max_tokens}]; got {self.min_tokens}")
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed < 2**63):
            raise ValueError(f"seed must be in [0, 2^63); got {self.seed}")
        _int_range("n", self.n, 1, MAX_N)
        if self.logprobs is not None:
            _int_range("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        _number("repetition_penalty", self.repetition_penalty, 0.0, exclusive=True)  # vLLM: any > 0
        _number("presence_penalty", self.presence_penalty, -2.0, high=2.0)
        _number("frequency_penalty", self.frequency_penalty, -2.0, high=2.0)
        _strings("stop_words", self.stop, MAX_STOP_STRINGS, "stop strings")
        _strings("bad_words", self.bad_words, MAX_BAD_WORDS, "bad words")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS} ids; got {len(self.stop_token_ids)}")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputs):
            raise ValueError("structured_outputs must be a StructuredOutputs (a dict of its fields is converted "
                             f"when SamplingParams is made); got {type(self.structured_outputs).__name__}")

    def check_token_ids(self, vocab_size: int) -> None:
        """stop_token_ids against the model's vocabulary: -1 or 10**12 would stop nothing."""
        bad = next((t for t in self.stop_token_ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise ValueError(f"stop_token_ids: token id {bad} is outside the vocabulary [0, {vocab_size})")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    # -- from JSON (the vLLM backend's sampling_parameters, request parameters) -------------------
    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "SamplingParams":
        """Settings from a JSON object whose values may be strings ("0.5", "true"), as the vLLM
        backend accepts them. `stop_words` is an alias of `stop`. Unknown keys are refused."""
        kwargs: dict[str, Any] = {}
        for key, value in fold_legacy_keys(data).items():
            name = "stop" if key == "stop_words" else key
            kind = _KINDS.get(name)
            if kind is None:
                raise ValueError(f"unknown sampling parameter '{key}'; allowed: {', '.join(KEYS)}")
            try:
                kwargs[name] = kind(value)
            except (TypeError, ValueError, OverflowError):  # OverflowError: float(10**400)
                raise ValueError(f"sampling parameter '{key}': bad value {_shown(value)}") from None
        return cls(**kwargs)


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _to_int(value: Any) -> int:
    if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
        raise ValueError
    return int(value)


def _to_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true"):
        return True
    if text in ("0", "false"):
        return False
    raise ValueError


def _to_strings(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise ValueError
    return list(value)


def _to_ints(value: Any) -> list[int]:
    if not isinstance(value, (list, tuple)):
        raise ValueError
    return [_to_int(v) for v in value]


def _optional_int(value: Any) -> Optional[int]:
    return None if value is None else _to_int(value)


_KINDS = {"max_tokens": _to_int, "temperature": float, "top_k": _to_int, "top_p": float,
          "seed": _optional_int, "stop": _to_strings, "stop_token_ids": _to_ints, "ignore_eos": _to_bool,
          "min_tokens": _to_int, "n": _to_int, "logprobs": _optional_int, "repetition_penalty": float,
          "presence_penalty": float, "frequency_penalty": float, "bad_words": _to_strings,
          "structured_outputs": StructuredOutputs.parse}
assert set(_KINDS) == {f.name for f in fields(SamplingParams)}
KEYS = tuple(_KINDS) + ("stop_words",) + tuple(k for k in OBJECT_KEYS + tuple(LEGACY_KEYS) if k not in _KINDS)
SamplingParams.KEYS = KEYS


def _int_range(name: str, value: Any, low: int, high: Optional[int] = None, hint: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        limit = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be an integer {limit}{hint}; got {value}")


def _number(name: str, value: Any, low: float, exclusive: bool = False, high: Optional[float] = None) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (value > low if exclusive else value >= low) and (high is None or value <= high)
    if not ok:
        limit = f"{'>' if exclusive else '>='} {low}" + (f" and <= {high}" if high is not None else "")
        raise ValueError(f"{name} must be a finite number {limit}; got {value}")


def _strings(name: str, values: list[str], most: int, what: str) -> None:
    if len(values) > most:
        raise ValueError(f"{name}: at most {most} {what}; got {len(values)}")
    for s in values:
        if not isinstance(s, str) or not s or len(s) > MAX_STOP_STRING_CHARS:
            raise ValueError(f"{name}: each entry must be a string of 1..{MAX_STOP_STRING_CHARS} characters")
        if lone_surrogate(s, name) is not None:  # "\ud800" would never match any text (and breaks encoders)
            raise ValueError(f"{name}: each entry must be valid Unicode text; {s!a} holds a lone surrogate")


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


class Request:
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
        self.kv_load = None  # its prefix on its way back from a KV tier (backend/kv_tiers/plan.KVLoad)
        # Sampling state lives with the request, so the sampler keeps none: one uniform number per
        # token from the request's own stream (a request's tokens do not depend on its batch).
        self.rng = random.Random(params.seed if params.seed is not None else seed)
        if index:
            self.rng = random.Random(f"{self.rng.getrandbits(63)}:{index}")
        self.bad_words_ids: list[list[int]] = []  # set by the engine, which has the tokenizer
        self.logprobs: Optional[list[dict]] = [] if params.logprobs is not None else None
        self.cumulative_logprob: Optional[float] = 0.0 if params.logprobs is not None else None
        self.grammar = None  # structured outputs: its GrammarState (backend/sched/grammar.py), set by the engine
        self.pending_grammar = None  # the Future of its constraint's compile until the engine attaches it
        # LoRA (docs/lora.md), set by the engine: the adapter it runs with (None: the base model) and
        # the root of its prefix-cache keys (the adapter's; b"" for the base model)
        self.lora_name: Optional[str] = None
        self.cache_salt = b""

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids(self, start: int, end: int) -> list[int]:
        """all_token_ids[start:end] without copying the rest (the runner asks for one token per step)."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n:end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - n]

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
