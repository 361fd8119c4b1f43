"""The logic between Triton and the engine, kept out of model.py and free of Triton imports.

- `engine_config`: config.pbtxt `parameters` + the instance's device -> `EngineConfig`.
- `parse_request`: a request's input tensors (numpy arrays by name) -> prompt, `SamplingParams`
  and flags, or a `ValueError` that says what is wrong and what is allowed.
- `Frontend`: hands requests to the engine and carries its outputs back. The engine calls back on
  its own thread; the callbacks only queue. One responder thread builds and sends the responses,
  so the engine loop never waits on Triton's IPC. It also polls `is_cancelled()` (an IPC round
  trip, ~75 us: each live request at most once per `cancel_interval`, at its outputs or, for one
  that has none, from a sweep every `poll_interval`) and keeps the metrics current.
  A request's output that is still waiting for the responder when the next one arrives takes the
  next one in (the new tokens and text concatenated), as vLLM's output collector does: while the
  responder keeps up, every step gets its own response; when it falls behind, each request gets
  one response carrying every step since its last, never later than it would have been sent.
  So the queue holds at most one entry per live request (plus `coalesce_after`, which tests raise
  to see the unmerged path) however fast the engine steps. `stream_interval` N > 1 holds a
  streaming request's outputs back until they carry N new tokens (its first token and its last
  output go at once): fewer responses, each an IPC that the engine waits for behind the GIL.
- `FaultInjector`: test-only faults in the model step, armed only by INFLIGHT_FAULT_INJECTION=1.

Triton specifics come in through three callables (model.py supplies them, tests supply fakes):
`respond(sender, tensors | None, error | None, final)`, the sender's `is_cancelled()`, and a
metrics object with `observe(kind, seconds)` and `update(stats)`. An `error` is an `Error`: a str
that also carries the Triton error code to answer with (INVALID_ARG, UNAVAILABLE or INTERNAL).
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import math
import os
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Union

import numpy as np

from backend.config import EngineConfig
from backend.request import MAX_STOP_STRINGS, SamplingParams

log = logging.getLogger("inflight.triton")

DEFAULT_MAX_TOKENS = 16
MAX_SAMPLING_PARAMETERS_BYTES = 1 << 20  # the sampling_parameters JSON
INPUT_NAMES = ("text_input", "input_ids", "max_tokens", "stream", "temperature", "top_k", "top_p", "seed",
               "stop_words", "ignore_eos", "min_tokens", "exclude_input_in_output", "stop",
               "sampling_parameters")
# Request parameters Triton itself may attach; any other parameter is refused (see check_parameters).
KNOWN_PARAMETERS = ("id", "priority", "timeout", "sequence_id", "sequence_start", "sequence_end")
SAMPLING_KEYS = ("max_tokens", "temperature", "top_k", "top_p", "seed", "stop", "stop_words",
                 "stop_token_ids", "ignore_eos", "min_tokens")


# -- configuration ---------------------------------------------------------------------------------

def engine_config(params: Mapping[str, str], instance_kind: str, device_id: int | str,
                  repo_root: Path) -> EngineConfig:
    """config.pbtxt parameters -> EngineConfig, in one place (EngineConfig.from_params validates).

    `device: auto` follows the instance: KIND_GPU -> cuda:<device_id>, anything else -> cpu.
    A relative `model_path` is taken from the repository root.
    """
    overrides: dict[str, Any] = {}
    if str(params.get("device", "auto")).strip() in ("", "auto"):
        overrides["device"] = f"cuda:{int(device_id)}" if instance_kind == "KIND_GPU" else "cpu"
    model_path = str(params.get("model_path", "")).strip()
    if model_path and not Path(model_path).is_absolute():
        overrides["model_path"] = str((Path(repo_root) / model_path).resolve())
    config = EngineConfig.from_params(params, **overrides)
    if not config.model_path:
        raise ValueError("parameter 'model_path' is required: a Hugging Face checkpoint folder")
    if not Path(config.model_path).is_dir():
        raise ValueError(f"parameter 'model_path': no checkpoint folder at {config.model_path} "
                         "(make one with `inflight make-model`, or point it at a HF checkpoint)")
    return config


# -- one request's tensors ---------------------------------------------------------------------------

@dataclass
class ParsedRequest:
    prompt: Union[str, list[int], None] = None
    params: Optional[SamplingParams] = None
    stream: bool = False
    exclude_input: bool = False
    stop: bool = False  # a request that cancels the running request with the same request id


def _one(name: str, array: np.ndarray) -> Any:
    if array.size != 1:
        raise ValueError(f"{name} must hold exactly one value; got shape {list(array.shape)}")
    return array.reshape(-1)[0]


def _int(name: str, array: np.ndarray) -> int:
    if array.dtype.kind not in "iu":
        raise ValueError(f"{name} must be an integer tensor; got {array.dtype}")
    return int(_one(name, array))


def _float(name: str, array: np.ndarray) -> float:
    if array.dtype.kind not in "fiu":
        raise ValueError(f"{name} must be a number tensor; got {array.dtype}")
    return float(_one(name, array))


def _bool(name: str, array: np.ndarray) -> bool:
    if array.dtype.kind != "b":
        raise ValueError(f"{name} must be a BOOL tensor; got {array.dtype}")
    return bool(_one(name, array))


def _text(name: str, value: Any) -> str:
    if isinstance(value, (bytes, np.bytes_)):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"{name} is not valid UTF-8") from None
    if isinstance(value, str):
        return value
    raise ValueError(f"{name} must be a BYTES (string) tensor; got {type(value).__name__}")


def _strings(name: str, array: np.ndarray) -> list[str]:
    if array.dtype.kind not in "OSU":
        raise ValueError(f"{name} must be a BYTES (string) tensor; got {array.dtype}")
    return [_text(name, v) for v in array.reshape(-1)]


def parse_request(inputs: Mapping[str, Optional[np.ndarray]], vocab_size: int,
                  max_model_len: Optional[int] = None, max_input_bytes: Optional[int] = None) -> ParsedRequest:
    """Validate the input tensors of one request. Raises ValueError naming the input and the rule.

    The size limits are checked before anything is decoded or copied: `max_input_bytes` on the
    text_input, `max_model_len` on the number of input_ids, and the stop-word count."""
    get = {k: v for k, v in inputs.items() if v is not None}
    if "stop" in get and _bool("stop", get["stop"]):
        return ParsedRequest(stop=True)

    text, ids = get.get("text_input"), get.get("input_ids")
    if text is not None and ids is not None:
        raise ValueError("send either text_input or input_ids, not both")
    if text is None and ids is None:
        raise ValueError("no prompt: send text_input (BYTES) or input_ids (INT32 [n])")
    prompt: Union[str, list[int]]
    if text is not None:
        if text.dtype.kind not in "OSU":
            raise ValueError(f"text_input must be a BYTES (string) tensor; got {text.dtype}")
        raw = _one("text_input", text)
        if max_input_bytes and isinstance(raw, (bytes, np.bytes_, str)) and len(raw) > max_input_bytes:
            size = len(raw) if not isinstance(raw, str) else len(raw.encode("utf-8"))
            if size > max_input_bytes:
                raise ValueError(f"text_input is {size} bytes; the limit is {max_input_bytes} bytes "
                                 f"(max_input_bytes" + (f"; max_model_len is {max_model_len} tokens)"
                                                        if max_model_len else ")"))
        prompt = _text("text_input", raw)
        if not prompt:
            raise ValueError("text_input is empty: the prompt needs at least one character")
    else:
        if ids.dtype.kind not in "iu":
            raise ValueError(f"input_ids must be an INT32 tensor; got {ids.dtype}")
        if ids.ndim != 1:
            raise ValueError(f"input_ids must be one-dimensional [n]; got shape {list(ids.shape)}")
        if ids.size == 0:
            raise ValueError("input_ids is empty: the prompt needs at least one token")
        if max_model_len and ids.size > max_model_len:
            raise ValueError(f"prompt has {ids.size} tokens; max_model_len is {max_model_len}")
        bad = ids[(ids < 0) | (ids >= vocab_size)]
        if bad.size:
            raise ValueError(f"input_ids: token id {int(bad[0])} is outside the vocabulary "
                             f"[0, {vocab_size})")
        prompt = [int(t) for t in ids]

    kwargs: dict[str, Any] = {"max_tokens": DEFAULT_MAX_TOKENS}
    if "sampling_parameters" in get:
        raw = _one("sampling_parameters", get["sampling_parameters"])
        if isinstance(raw, (bytes, np.bytes_, str)) and len(raw) > MAX_SAMPLING_PARAMETERS_BYTES:
            raise ValueError(f"sampling_parameters is {len(raw)} bytes; the limit is "
                             f"{MAX_SAMPLING_PARAMETERS_BYTES} bytes")
        kwargs.update(_sampling_json(_text("sampling_parameters", raw)))
    for name, conv in (("max_tokens", _int), ("top_k", _int), ("min_tokens", _int), ("seed", _int),
                       ("temperature", _float), ("top_p", _float), ("ignore_eos", _bool)):
        if name in get:
            kwargs[name] = conv(name, get[name])
    if "stop_words" in get:
        if get["stop_words"].size > MAX_STOP_STRINGS:
            raise ValueError(f"stop_words: at most {MAX_STOP_STRINGS} stop strings; got {get['stop_words'].size}")
        kwargs["stop"] = _strings("stop_words", get["stop_words"])
    if kwargs["max_tokens"] < 1:
        hint = (" (max_tokens is an INT32: a value past 2147483647 wraps around to a negative one)"
                if kwargs["max_tokens"] < 0 else "")
        raise ValueError(f"max_tokens must be >= 1; got {kwargs['max_tokens']}{hint}")
    for name in ("temperature", "top_p"):
        if name in kwargs and math.isnan(kwargs[name]):
            raise ValueError(f"{name} must be a number; got NaN")
    params = SamplingParams(**kwargs)  # raises ValueError with the field and its range
    return ParsedRequest(prompt=prompt, params=params,
                         stream=_bool("stream", get["stream"]) if "stream" in get else False,
                         exclude_input=(_bool("exclude_input_in_output", get["exclude_input_in_output"])
                                        if "exclude_input_in_output" in get else False))


def check_parameters(raw: Optional[str]) -> None:
    """Refuse request parameters the model does not know. Triton's HTTP generate endpoints turn
    every JSON field that is not an input into a request parameter, so a misspelt option
    ("max_token": 100) would otherwise be dropped without a word. Over gRPC, unknown inputs are
    refused by Triton itself."""
    if not raw or raw == "{}":
        return
    try:
        params = json.loads(raw)
    except ValueError:
        return
    if not isinstance(params, dict):
        return
    unknown = sorted(k for k in params if k not in KNOWN_PARAMETERS and not k.startswith("triton_"))
    if unknown:
        raise ValueError(f"unknown input(s) {', '.join(repr(k) for k in unknown)}; the inputs are "
                         f"{', '.join(INPUT_NAMES)} (over HTTP generate, a JSON field that is not an "
                         "input arrives as a request parameter: check its spelling)")


def _sampling_json(raw: str) -> dict[str, Any]:
    """The vLLM backend's `sampling_parameters` JSON (values may be strings, as that backend allows)."""
    try:
        data = json.loads(raw) if raw.strip() else {}
    except json.JSONDecodeError as exc:
        raise ValueError(f"sampling_parameters is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError("sampling_parameters must be a JSON object")
    out: dict[str, Any] = {}
    for key, value in data.items():
        if key not in SAMPLING_KEYS:
            raise ValueError(f"sampling_parameters: unknown key '{key}'; allowed: {', '.join(SAMPLING_KEYS)}")
        try:
            if key in ("max_tokens", "top_k", "min_tokens", "seed"):
                out[key] = int(value)
            elif key in ("temperature", "top_p"):
                out[key] = float(value)
            elif key == "ignore_eos":
                out[key] = value if isinstance(value, bool) else str(value).lower() in ("1", "true")
            elif key in ("stop", "stop_words"):
                out["stop"] = [value] if isinstance(value, str) else [str(v) for v in value]
            elif key == "stop_token_ids":
                out[key] = [int(v) for v in value]
        except (TypeError, ValueError):
            raise ValueError(f"sampling_parameters: bad value for '{key}': {value!r}") from None
    return out


# -- errors ----------------------------------------------------------------------------------------

class Error(str):
    """An error message for a client, with the Triton error code to answer it with.

    INVALID_ARG: the request is wrong (fix it; gRPC INVALID_ARGUMENT, HTTP 400).
    UNAVAILABLE: the server cannot take it now (the queue is full, it is shutting down): retry later.
    INTERNAL: the server failed it (a failed model step)."""
    code: str

    def __new__(cls, message: str, code: str = "INTERNAL") -> "Error":
        self = super().__new__(cls, message)
        self.code = code
        return self


class ServerClosing(RuntimeError):
    """The model is being unloaded: new requests are refused."""


def error_for(exc: BaseException) -> Error:
    """The message and code a refused request gets for an exception."""
    if isinstance(exc, ValueError):
        return Error(str(exc) or type(exc).__name__, "INVALID_ARG")
    # QueueFullError and EngineDeadError live in backend.engine, which this module does not import
    # (it would load torch before the config is checked): they are known by name.
    if isinstance(exc, ServerClosing) or type(exc).__name__ in ("QueueFullError", "EngineDeadError"):
        return Error(str(exc) or type(exc).__name__, "UNAVAILABLE")
    return Error(f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__, "INTERNAL")


# -- the responses -----------------------------------------------------------------------------------

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
    last_token_time: Optional[float] = None
    last_cancel_check: float = 0.0
    cancelled: bool = False
    done: bool = False
    # Its newest output still waiting for the responder, which later ones may be merged into, and
    # (stream_interval > 1) outputs held back until they carry enough tokens. Both guarded by
    # Frontend._pending_lock.
    waiting: Optional["_Entry"] = None
    held: Any = None
    answered: bool = False  # an output with tokens has been queued


class _Entry:
    """One queued engine output (possibly several merged): the output, when the first and the last
    merged output arrived, and whether the responder has taken it."""
    __slots__ = ("live", "out", "t_first", "t_last", "taken")

    def __init__(self, live: Live, out: Any, t: float):
        self.live, self.out, self.t_first, self.t_last, self.taken = live, out, t, t, False


def output_tensors(live: Live, out: Any, prompt_ids_text: Callable[[list[int]], str]) -> dict[str, np.ndarray]:
    """The output tensors of one response: the step's new tokens when streaming, all of them at the end
    otherwise (with the prompt in front unless exclude_input_in_output)."""
    if live.stream:
        text, ids = out.new_text, list(out.new_token_ids)
    else:
        text, ids = out.text, list(out.token_ids)
        if not live.exclude_input:
            prompt = live.prompt_text if live.prompt_text is not None else prompt_ids_text(out.prompt_token_ids)
            text, ids = prompt + text, list(out.prompt_token_ids) + ids
    return {
        "text_output": np.array([text.encode("utf-8")], dtype=np.object_),
        "output_ids": np.array(ids, dtype=np.int32),
        "finish_reason": np.array([(out.finish_reason or "").encode()], dtype=np.object_),
        "num_input_tokens": np.array([len(out.prompt_token_ids)], dtype=np.int32),
        "num_output_tokens": np.array([len(out.token_ids)], dtype=np.int32),
    }


def merge_outputs(first: Any, then: Any) -> Any:
    """One engine output that carries `first`'s new tokens and text followed by `then`'s, and
    `then`'s totals and state (finished, finish_reason, error)."""
    return dataclasses.replace(then, new_token_ids=list(first.new_token_ids) + list(then.new_token_ids),
                               new_text=first.new_text + then.new_text)


Respond = Callable[[Any, Optional[dict], Optional[str], bool], None]


class NullMetrics:
    def observe(self, kind: str, seconds: float) -> None:
        pass

    def update(self, stats: Mapping[str, float]) -> None:
        pass


class Frontend:
    """Routes requests into the engine and its outputs back out; see the module docstring."""

    def __init__(self, engine: Any, respond: Respond, metrics: Any = None,
                 poll_interval: float = 0.05, stats_interval: float = 0.1, cancel_interval: float = 0.2,
                 stop_file: Optional[Path] = None, coalesce_after: int = 0,
                 stream_interval: int = 1):
        self.engine = engine
        # `inflight serve` creates this file just before it stops Triton: Triton unloads a decoupled
        # model only once all its requests are answered, so every running request is aborted then.
        self.stop_file = stop_file
        self.respond = respond
        self.metrics = metrics or NullMetrics()
        self.poll_interval = poll_interval
        # 64 streams polled every 50 ms took a third of the responder's time on 2 cores; a client
        # that went away now costs at most this much more compute before its request is aborted.
        self.cancel_interval = cancel_interval
        self.stats_interval = stats_interval
        self._lock = threading.Lock()
        self._pending_lock = threading.Lock()
        self._live: dict[str, Live] = {}
        self._ids = itertools.count()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()  # _Entry objects
        self._queued = 0  # entries in _queue not yet taken (guarded by _pending_lock)
        self.coalesce_after = coalesce_after
        self.stream_interval = stream_interval
        self.max_queued = 0  # the deepest the queue has been
        self.num_coalesced = 0  # engine outputs merged into an earlier one that was still waiting
        self._closing = False
        self._stats_dirty = True
        self._thread = threading.Thread(target=self._run, name="inflight-responder", daemon=True)
        self._thread.start()

    # -- called on Triton's thread ---------------------------------------------------------------
    def submit(self, client_id: str, inputs: Mapping[str, Optional[np.ndarray]], sender: Any,
               parameters: Optional[str] = None) -> None:
        """Validate one request and hand it to the engine; on any refusal answer it at once.
        `parameters` is the request's parameters as Triton gives them (a JSON object)."""
        try:
            check_parameters(parameters)
            parsed = parse_request(inputs, self.engine.vocab_size,
                                   max_model_len=getattr(self.engine, "max_model_len", None),
                                   max_input_bytes=getattr(self.engine, "max_input_bytes", None))
            if parsed.stop:
                self._stop(client_id, sender)
                return
            if self._closing:
                raise ServerClosing("the server is shutting down; retry later")
            live = Live(key=f"{client_id or 'req'}#{next(self._ids)}", client_id=client_id,
                        sender=sender, stream=parsed.stream, exclude_input=parsed.exclude_input,
                        prompt_text=parsed.prompt if isinstance(parsed.prompt, str) else None,
                        arrival=time.monotonic())
            with self._lock:
                if client_id and any(lv.client_id == client_id and not lv.done for lv in self._live.values()):
                    raise ValueError(f"request id '{client_id}' is already in use by a running request; "
                                     "give each request its own id (or stop the running one first)")
                self._live[live.key] = live
            try:
                self.engine.add_request(live.key, parsed.prompt, parsed.params,
                                        lambda out, live=live: self._on_output(live, out))
            except BaseException:
                with self._lock:
                    self._live.pop(live.key, None)
                raise
            self._stats_dirty = True
        except Exception as exc:  # ValueError (bad request), QueueFullError, engine refusal
            self.respond(sender, None, error_for(exc), True)

    def _stop(self, client_id: str, sender: Any) -> None:
        if not client_id:
            raise ValueError("stop=true needs the request id of the request to cancel "
                             "(set the same request id as that request)")
        with self._lock:
            targets = [lv for lv in self._live.values() if lv.client_id == client_id and not lv.done]
        stopped = sum(1 for lv in targets if self.engine.abort(lv.key))
        if not stopped:
            raise ValueError(f"stop: no request with id '{client_id}' is running")
        tensors = {
            "text_output": np.array([b""], dtype=np.object_),
            "output_ids": np.zeros([0], dtype=np.int32),
            "finish_reason": np.array([b"abort"], dtype=np.object_),
            "num_input_tokens": np.zeros([1], dtype=np.int32),
            "num_output_tokens": np.zeros([1], dtype=np.int32),
        }
        self.respond(sender, tensors, None, True)

    def num_live(self) -> int:
        with self._lock:
            return len(self._live)

    # -- called on the engine's thread -------------------------------------------------------------
    def _on_output(self, live: Live, out: Any) -> None:
        """Queue an output for the responder; when the responder is behind, merge it into this
        request's output that is still waiting instead."""
        now = time.monotonic()
        with self._pending_lock:
            if live.held is not None:
                out, live.held = merge_outputs(live.held, out), None
            if (live.stream and live.answered and not out.finished
                    and len(out.new_token_ids) < self.stream_interval):
                live.held = out
                return
            live.answered = live.answered or bool(out.new_token_ids)
            entry = live.waiting
            if entry is not None and self._queued > self.coalesce_after:
                entry.out = merge_outputs(entry.out, out)
                entry.t_last = now
                self.num_coalesced += 1
                return
            entry = live.waiting = _Entry(live, out, now)
            self._queued += 1
            self.max_queued = max(self.max_queued, self._queued)
        self._queue.put(entry)

    def queue_depth(self) -> int:
        """Outputs waiting for the responder."""
        with self._pending_lock:
            return self._queued

    # -- the responder thread ----------------------------------------------------------------------
    def _run(self) -> None:
        last_poll = last_stats = time.monotonic()
        while True:
            try:
                item = self._queue.get(timeout=self.poll_interval)
            except queue.Empty:
                item = None
            if item is _CLOSE:
                break
            if item is not None:
                with self._pending_lock:  # from here on, nothing is merged into it
                    item.taken = True
                    self._queued -= 1
                    if item.live.waiting is item:
                        item.live.waiting = None
                try:
                    self._handle(item.live, item.out, item.t_first, item.t_last)
                except Exception:
                    log.exception("responding failed")
            now = time.monotonic()
            if now - last_poll >= self.poll_interval:
                last_poll = now
                self._poll_cancelled()
                if self.stop_file is not None and not self._closing and self.stop_file.exists():
                    self.abort_all()
            if self._stats_dirty or now - last_stats >= self.stats_interval:
                last_stats = now
                self._stats_dirty = False
                self._update_stats()

    def _handle(self, live: Live, out: Any, t_first: float, t: float) -> None:
        if live.done:
            return
        now = time.monotonic()
        if not out.finished and not live.cancelled and now - live.last_cancel_check >= self.cancel_interval:
            live.last_cancel_check = now
            if _is_cancelled(live.sender):
                live.cancelled = True
                self.engine.abort(live.key)
        if out.new_token_ids:
            if live.last_token_time is None:
                self.metrics.observe("ttft", t_first - live.arrival)
            else:
                self.metrics.observe("itl", (t - live.last_token_time) / len(out.new_token_ids))
            live.last_token_time = t
        if out.finished:
            self._finish(live, out, t)
        elif live.stream and not live.cancelled:
            self.respond(live.sender, output_tensors(live, out, self._detok), None, False)

    def _finish(self, live: Live, out: Any, t: float) -> None:
        live.done = True
        with self._lock:
            self._live.pop(live.key, None)
        self._stats_dirty = True
        self.metrics.observe("e2e", t - live.arrival)
        if live.cancelled:  # nobody listens: just close the request
            self.respond(live.sender, None, None, True)
        elif out.finish_reason == "error":
            self.respond(live.sender, None, Error(out.error or "the engine failed this request"), True)
        else:
            self.respond(live.sender, output_tensors(live, out, self._detok), None, True)

    def _detok(self, ids: list[int]) -> str:
        tok = self.engine.tokenizer
        return tok.decode(ids) if tok is not None else ""

    def _poll_cancelled(self) -> None:
        """Check the requests no output has checked lately (each check is an IPC round trip)."""
        recent = time.monotonic() - self.cancel_interval
        with self._lock:
            pending = [lv for lv in self._live.values()
                       if not lv.cancelled and not lv.done and lv.last_cancel_check < recent]
        for live in pending:
            live.last_cancel_check = time.monotonic()
            if _is_cancelled(live.sender):
                live.cancelled = True
                self.engine.abort(live.key)

    def _update_stats(self) -> None:
        try:
            self.metrics.update(self.engine.stats())
        except Exception:
            log.exception("metrics update failed")

    # -- shutdown ------------------------------------------------------------------------------------
    def abort_all(self) -> None:
        """Refuse new requests and abort the running ones (each ends with 'abort' and FINAL)."""
        self._closing = True
        with self._lock:
            keys = [lv.key for lv in self._live.values() if not lv.done]
        for key in keys:
            self.engine.abort(key)

    def close(self, timeout: float = 10.0) -> None:
        """Stop taking requests, let the engine abort what runs, answer everything, stop the thread."""
        self._closing = True
        try:
            self.engine.shutdown()  # delivers a final 'abort' output for every request it knows
        except Exception:
            log.exception("engine shutdown failed")
        deadline = time.monotonic() + timeout
        while self.num_live() and time.monotonic() < deadline:
            time.sleep(0.02)
        self._queue.put(_CLOSE)
        self._thread.join(timeout)
        with self._lock:
            left, self._live = list(self._live.values()), {}
        for live in left:  # the engine never answered these: close them ourselves
            try:
                self.respond(live.sender, None, Error("the model was unloaded before this request finished",
                                                      "UNAVAILABLE"), True)
            except Exception:
                pass


_CLOSE = object()


def _is_cancelled(sender: Any) -> bool:
    try:
        return bool(sender.is_cancelled())
    except Exception:
        return False


# -- fault injection (tests only) -----------------------------------------------------------------------

FAULT_ENV = "INFLIGHT_FAULT_INJECTION"  # "1" at server start arms the injector
FAULT_FILE_ENV = "INFLIGHT_FAULT_FILE"  # where the trigger file is (default: <model dir>/.inflight-fault)
FAULT_FILE = ".inflight-fault"


class InjectedFault(RuntimeError):
    """A failure made on purpose by the fault injector."""


class FaultInjector:
    """Test-only faults, so the tests can prove that a failed model step fails only its requests.

    Armed only when the server starts with INFLIGHT_FAULT_INJECTION=1 (never set it in production);
    otherwise nothing is installed and no file is ever looked at. Armed, it reads the trigger file
    before every model step:
    - `model_step N`: the next N steps raise InjectedFault inside the model run (each consumed step
      is written back; the file is removed at 0);
    - `stall`: every step waits while the file says so (at most STALL_LIMIT_S each), like a hung
      device: the queue then holds still while a test looks at it. Remove the file to go on.
    The server log says when the injector is armed."""

    STALL_LIMIT_S = 60.0

    def __init__(self, path: Path):
        self.path = Path(path)
        self.injected = 0

    @classmethod
    def from_env(cls, model_dir: Path, environ: Mapping[str, str] = os.environ) -> Optional["FaultInjector"]:
        if environ.get(FAULT_ENV, "") != "1":
            return None
        return cls(Path(environ.get(FAULT_FILE_ENV) or Path(model_dir) / FAULT_FILE))

    def _words(self) -> list[str]:
        try:
            return self.path.read_text().split()
        except OSError:
            return []

    def stall(self) -> float:
        """Wait while the trigger file says `stall`; the seconds waited."""
        started = time.monotonic()
        while self._words() == ["stall"] and time.monotonic() - started < self.STALL_LIMIT_S:
            time.sleep(0.005)
        return time.monotonic() - started

    def take(self, kind: str) -> bool:
        """Consume one `kind` fault from the trigger file; True when one was there."""
        words = self._words()
        if len(words) != 2 or words[0] != kind or not words[1].isdigit() or int(words[1]) < 1:
            return False
        left = int(words[1]) - 1
        if left:
            self.path.write_text(f"{kind} {left}\n")
        else:
            self.path.unlink(missing_ok=True)
        self.injected += 1
        return True

    def install(self, engine: Any) -> None:
        """Wrap the model run of an AsyncEngine (or LLMEngine) so that armed steps raise."""
        core = getattr(engine, "engine", engine)
        runner = core.runner
        real_run = runner.run

        def run(*args, **kwargs):
            self.stall()
            if self.take("model_step"):
                raise InjectedFault("injected fault in the model step (INFLIGHT_FAULT_INJECTION)")
            return real_run(*args, **kwargs)

        runner.run = run
