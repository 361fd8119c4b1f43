"""A request's sampling parameters, checked once, and each sequence's random stream. No torch here.

`SamplingParams` is the one place a request's settings are checked: the Triton adapter, the OpenAI
server and the Python API all build one (from tensors, JSON or keywords) and its `validate` names
the field and the limit of anything out of range.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, field, fields
from typing import Any, Mapping, Optional

from backend.core import defaults
from backend.core.beam_params import check_beams
from backend.core.input_guard import lone_surrogate
from backend.core.structured import LEGACY_KEYS, OBJECT_KEYS, StructuredOutputs, fold_legacy_keys

MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 256
MAX_BAD_WORDS = 64
MAX_N = 64
MAX_LOGPROBS = 20  # vLLM's default max_logprobs
MAX_LOGIT_BIAS = 1024  # entries of logit_bias
MAX_BIAS = 100.0  # OpenAI's range of a logit_bias value: [-100, 100]
MAX_ALLOWED_TOKEN_IDS = 1 << 18  # entries of allowed_token_ids (a whole 256k vocabulary)
GREEDY_BELOW = 1e-5  # vLLM's _SAMPLING_EPS: a lower temperature is greedy decoding


@dataclass
class SamplingParams:
    """vLLM-style sampling settings. A temperature below 1e-5 means greedy."""
    max_tokens: int = defaults.MAX_TOKENS
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
    # vLLM's: tokens below min_p x the most likely one's probability (after temperature) are dropped
    min_p: float = 0.0
    logit_bias: Optional[dict[int, float]] = None  # token id -> added to its logit, in [-100, 100]
    allowed_token_ids: Optional[list[int]] = None  # only these tokens may be sampled
    prompt_logprobs: Optional[int] = None  # None: none; k: each prompt token's logprob and the top k
    include_stop_str_in_output: bool = False  # a stop string (or stop token's text) ends the text too
    skip_special_tokens: bool = True  # special tokens are left out of the text
    spaces_between_special_tokens: bool = True  # False: added tokens' texts are joined with nothing between
    truncate_prompt_tokens: Optional[int] = None  # k: only the prompt's last k tokens; -1: max_model_len
    # refused at arrival when the queue cannot give the first token within this (ms); None: the
    # engine's ttft_target_ms; 0: no target (backend/sched/drain.py)
    ttft_target_ms: Optional[float] = None
    # Beam search (backend/sched/beams.py, docs/beam_search.md): `best_of` beams (n when unset) kept
    # per step, the best n returned; finished beams scored by sum of logprobs / length**length_penalty;
    # early_stopping True | False | "never" as transformers' generate(num_beams=...)
    use_beam_search: bool = False
    best_of: Optional[int] = None
    length_penalty: float = 1.0
    early_stopping: Any = False

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
        _number("min_p", self.min_p, 0.0, high=1.0)
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or len(self.logit_bias) > MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias must map at most {MAX_LOGIT_BIAS} token ids to biases")
            for tok, bias in self.logit_bias.items():
                _int_range("logit_bias", tok, 0, hint=" (token ids as keys)")
                _number("logit_bias", bias, -MAX_BIAS, high=MAX_BIAS)
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if not isinstance(ids, list) or not 1 <= len(ids) <= MAX_ALLOWED_TOKEN_IDS:
                raise ValueError(f"allowed_token_ids must list 1..{MAX_ALLOWED_TOKEN_IDS} token ids")
            for tok in ids:
                _int_range("allowed_token_ids", tok, 0)
        if self.prompt_logprobs is not None:
            _int_range("prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS)
        for name in ("include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a boolean; got {getattr(self, name)!r}")
        t = self.truncate_prompt_tokens
        if t is not None and (isinstance(t, bool) or not isinstance(t, int) or (t < 1 and t != -1)):
            raise ValueError(f"truncate_prompt_tokens must be an integer >= 1, or -1 (max_model_len); got {t}")
        if self.ttft_target_ms is not None:
            _number("ttft_target_ms", self.ttft_target_ms, 0.0, high=600_000.0)
        check_beams(self)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputs):
            raise ValueError("structured_outputs must be a StructuredOutputs (a dict of its fields is converted "
                             f"when SamplingParams is made); got {type(self.structured_outputs).__name__}")

    def check_token_ids(self, vocab_size: int) -> None:
        """Token ids against the model's vocabulary: a stop token of -1 or 10**12 would stop nothing,
        a bias or an allowed token past it would mean nothing."""
        for name, ids in (("stop_token_ids", self.stop_token_ids), ("logit_bias", self.logit_bias or ()),
                          ("allowed_token_ids", self.allowed_token_ids or ())):
            bad = next((t for t in ids if not 0 <= t < vocab_size), None)
            if bad is not None:
                raise ValueError(f"{name}: token id {bad} is outside the vocabulary [0, {vocab_size})")

    @property
    def biased(self) -> bool:
        """Whether logit_bias or allowed_token_ids change this request's logits."""
        return bool(self.logit_bias) or self.allowed_token_ids is not None

    @property
    def beam_width(self) -> int:
        """Beams kept per step: best_of (n when unset) with use_beam_search, else 1 (no beams)."""
        return (self.best_of or self.n) if self.use_beam_search else 1

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
        if kwargs.get("use_beam_search") and "temperature" not in kwargs:
            kwargs["temperature"] = 0.0  # beams rank raw logprobs: no temperature sent is not one refused
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


def _optional_float(value: Any) -> Optional[float]:
    return None if value is None else _to_float(value)


def _optional_ints(value: Any) -> Optional[list[int]]:
    return None if value is None else _to_ints(value)


def _to_bias(value: Any) -> Optional[dict[int, float]]:
    """OpenAI's logit_bias: {"token id": bias}; the JSON's string keys become ints."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise ValueError
    return {_to_int(k.strip() if isinstance(k, str) else k): _to_float(v) for k, v in value.items()}


def _to_float(value: Any) -> float:
    if isinstance(value, bool):
        raise ValueError
    return float(value)


_KINDS = {"max_tokens": _to_int, "temperature": float, "top_k": _to_int, "top_p": float,
          "seed": _optional_int, "stop": _to_strings, "stop_token_ids": _to_ints, "ignore_eos": _to_bool,
          "min_tokens": _to_int, "n": _to_int, "logprobs": _optional_int, "repetition_penalty": float,
          "presence_penalty": float, "frequency_penalty": float, "bad_words": _to_strings,
          "structured_outputs": StructuredOutputs.parse, "min_p": float, "logit_bias": _to_bias,
          "allowed_token_ids": _optional_ints, "prompt_logprobs": _optional_int,
          "include_stop_str_in_output": _to_bool, "skip_special_tokens": _to_bool,
          "spaces_between_special_tokens": _to_bool, "truncate_prompt_tokens": _optional_int,
          "ttft_target_ms": _optional_float, "use_beam_search": _to_bool, "best_of": _optional_int,
          "length_penalty": float, "early_stopping": lambda v: "never" if v == "never" else _to_bool(v)}
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


def sampling_stream(params: SamplingParams, seed: int, index: int = 0) -> random.Random:
    """A sequence's own random stream: one uniform number per sampled token (a request's tokens do
    not depend on its batch). Seeded by the request's `seed`, else by `seed` (the engine's draw for
    it); the index-th of its n completions gets a stream of its own, derived from that seed."""
    rng = random.Random(params.seed if params.seed is not None else seed)
    if index:
        rng = random.Random(f"{rng.getrandbits(63)}:{index}")
    return rng
