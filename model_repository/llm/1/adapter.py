"""The logic between Triton and the engine, kept out of model.py and free of Triton imports.

- `engine_config` (instance_config.py): config.pbtxt `parameters` + the instance's device -> `EngineConfig`.
- `parse_request` (triton_inputs.py beside this file): a request's input tensors -> prompt,
  `SamplingParams` and flags, or a `ValueError` that says what is wrong and what is allowed;
  `error_for` (triton_errors.py): the message and Triton error code a refused request gets.
- `Frontend`: hands requests to the engine and carries its outputs back. The engine calls back on
  its own thread; the callbacks only queue. One responder thread builds and sends the responses,
  so the engine loop never waits on Triton's IPC. It also polls `is_cancelled()` (an IPC round
  trip, ~75 us: each live request at most once per `cancel_interval`, at its outputs or, for one
  that has none, from a sweep every `poll_interval`). Every metric IPC (histogram samples, the
  engine's gauges) runs on a metrics thread of its own (triton_outputs.MetricsWriter).
  Streaming, every engine step is its own response, as the vLLM backend sends them and clients
  count them, also while the responder is behind. Only past `MAX_STREAM_BACKLOG` responses of
  one request waiting for the responder are its next outputs merged into the newest waiting one
  (the new tokens and text concatenated, never later than it would have been sent), so the queue
  holds at most that many entries per live request however fast the engine steps.
  `stream_interval` N > 1 holds a streaming request's outputs back until they carry N new tokens
  (its first token and its last output go at once): fewer responses, each an IPC that the engine
  waits for behind the GIL. The inter-token histogram and `num_output_tokens` count tokens,
  whatever a response carries.
- `output_tensors` (triton_outputs.py): a response's tensors, as the vLLM backend's additional
  outputs contract shapes them; `MetricsWriter`: the metrics thread.
- `FaultInjector` (fault_injection.py): test-only faults in the model step, armed only by
  INFLIGHT_FAULT_INJECTION=1.

Triton specifics come in through three callables (model.py supplies them, tests supply fakes):
`respond(sender, tensors | None, error | None, final)`, the sender's `is_cancelled()`, and a
metrics object with `observe(kind, seconds)` and `update(stats)`. An `error` is an `Error`: a str
that also carries the Triton error code to answer with (INVALID_ARG, UNAVAILABLE or INTERNAL).
"""
from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

import numpy as np

from backend.core.outputs import merge_outputs
from fault_injection import FAULT_ENV, FaultInjector
from instance_config import engine_config, engine_report
from live_request import Live, NullMetrics, Respond, _Entry
from pooling_door import pooling_params
from lora_control import LoRAControl, control_of
from triton_errors import Error, ServerClosing, error_for
from triton_inputs import DEFAULT_MAX_TOKENS, INPUT_NAMES, parse_request
from triton_outputs import MetricsWriter, output_tensors

# What model.py and the tests use, from here and from the modules beside this one.
__all__ = ["DEFAULT_MAX_TOKENS", "Error", "FAULT_ENV", "FaultInjector", "Frontend", "INPUT_NAMES",
           "engine_config", "engine_report", "error_for", "parse_request"]

log = logging.getLogger("inflight.triton")

# Responses of one streaming request that may wait for the responder before its next outputs are
# merged into the newest of them (docs/triton.md): memory stays bounded per live request while a
# responder that is only briefly behind still sends one response per engine step.
MAX_STREAM_BACKLOG = 8


class Frontend:
    """Routes requests into the engine and its outputs back out; see the module docstring."""

    def __init__(self, engine: Any, respond: Respond, metrics: Any = None,
                 poll_interval: float = 0.05, stats_interval: float = 0.1, cancel_interval: float = 0.2,
                 stop_file: Optional[Path] = None, max_backlog: int = MAX_STREAM_BACKLOG,
                 stream_interval: int = 1, on_engine_failure: Optional[Callable[[str], None]] = None,
                 runtime_lora: bool = False):
        self.engine = engine
        # `inflight serve` creates this file just before it stops Triton: Triton unloads a decoupled
        # model only once all its requests are answered, so every running request is aborted then.
        self.stop_file = stop_file
        self.respond = respond
        # requests with the parameter lora_action load / unload / list adapters (lora_control.py)
        self.lora_control = LoRAControl(engine, respond, runtime_lora)
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
        self.max_backlog = max(1, max_backlog)
        self.stream_interval = stream_interval
        self.max_queued = 0  # the deepest the queue has been
        self.num_coalesced = 0  # engine outputs merged into an earlier one that was still waiting
        self._closing = False
        # Called once, from the responder thread, when the engine stops serving (model.py marks the
        # model not ready); new requests are refused with UNAVAILABLE either way.
        self.on_engine_failure = on_engine_failure
        self._failure_reported = False
        self.metrics_writer = MetricsWriter(self.metrics, stats_interval, self.engine.stats)
        self._thread = threading.Thread(target=self._run, name="inflight-responder", daemon=True)
        self._thread.start()

    # -- called on Triton's thread ---------------------------------------------------------------
    def submit(self, client_id: str, inputs: Mapping[str, Optional[np.ndarray]], sender: Any,
               parameters: Optional[str] = None, outputs: Optional[frozenset] = None) -> None:
        """Validate one request and hand it to the engine; on any refusal answer it at once.
        `parameters` is the request's parameters as Triton gives them (a JSON object); `outputs` the
        outputs it asked for (empty: all)."""
        control = control_of(parameters)
        if control is not None:
            self.lora_control.handle(control, sender)
            return
        try:
            parsed = parse_request(inputs, parameters,
                                   max_input_bytes=getattr(self.engine, "max_input_bytes", None),
                                   max_model_len=getattr(self.engine, "max_model_len", None),
                                   vocab_size=getattr(self.engine, "vocab_size", None), encode=self._encode)
            if parsed.stop:
                self._stop(client_id, sender, parsed.returns)
                return
            if self._closing:
                raise ServerClosing("the server is shutting down; retry later")
            pooling = pooling_params(parsed, self.engine, outputs)  # a pooling model's request (pooling_door.py)
            live = Live(key=f"{client_id or 'req'}#{next(self._ids)}", client_id=client_id,
                        sender=sender, stream=parsed.stream, exclude_input=parsed.exclude_input,
                        prompt_text=parsed.prompt if isinstance(parsed.prompt, str) else None,
                        arrival=time.monotonic(), n=parsed.params.n, unfinished=parsed.params.n,
                        returns=parsed.returns, reasoning=parsed.reasoning_parser,
                        beams=parsed.params.use_beam_search)
            with self._lock:
                if client_id and any(lv.client_id == client_id and not lv.done for lv in self._live.values()):
                    raise ValueError(f"request id '{client_id}' is already in use by a running request; "
                                     "give each request its own id (or stop the running one first)")
                self._live[live.key] = live
            # asked for only when set, so engines without queue reports or LoRA (tests' fakes) still work
            queue = {"queue_info": True} if "return_queue_info" in parsed.returns else {}
            if parsed.lora_name is not None:
                queue["lora_request"] = parsed.lora_name
            if pooling is not None:
                queue["pooling"] = pooling
            try:
                self.engine.add_request(live.key, parsed.engine_prompt, parsed.params,
                                        lambda out, live=live: self._on_output(live, out),
                                        priority=parsed.priority, **queue)
            except BaseException:
                with self._lock:
                    self._live.pop(live.key, None)
                raise
            self.metrics_writer.poke()
        except Exception as exc:  # ValueError (bad request), QueueFullError, engine refusal
            self.respond(sender, None, error_for(exc), True)

    def _stop(self, client_id: str, sender: Any, returns: frozenset) -> None:
        if not client_id:
            raise ValueError("stop=true needs the request id of the request to cancel "
                             "(set the same request id as that request)")
        with self._lock:
            targets = [lv for lv in self._live.values() if lv.client_id == client_id and not lv.done]
        stopped = sum(1 for lv in targets if self.engine.abort(lv.key))
        if not stopped:
            raise ValueError(f"stop: no request with id '{client_id}' is running")
        # The stop request's own answer: nothing generated; 'abort' (what it did) if it asks.
        tensors = {"text_output": np.array([b""], dtype=np.object_), "output_ids": np.zeros([0], dtype=np.int32)}
        if "return_finish_reason" in returns:
            tensors["finish_reason"] = np.array([b"abort"], dtype=np.object_)
        self.respond(sender, tensors, None, True)

    def num_live(self) -> int:
        with self._lock:
            return len(self._live)

    # -- called on the engine's thread -------------------------------------------------------------
    def _on_output(self, live: Live, out: Any) -> None:
        """Queue an output for the responder; when this request already has `max_backlog` entries
        waiting for it, merge the output into the newest of them instead."""
        now = time.monotonic()
        if not live.stream and not out.new_token_ids and not out.finished:
            return  # where it stands while it waits: streamed only (its answer carries the last)
        with self._pending_lock:
            i = out.index
            held = live.held.pop(i, None)
            if held is not None:
                # Streaming: the held tokens and text go out with this output. Not streaming: the
                # answer is built from the totals, so the newest output replaces the held one
                # (merging would copy the whole answer so far at every step).
                out = merge_outputs(held, out) if live.stream else out
            if out.finished:  # an error ends every completion (the engine may send it once for all n)
                live.unfinished = 0 if out.finish_reason == "error" else live.unfinished - 1
            # After its first token, a non-streaming request has nothing to send until every
            # completion has ended: its outputs are held (no responder wake-up, no per-step ITL
            # metric IPC), and the last one carries the mean gap since the first token.
            if live.answered and (live.unfinished > 0 if not live.stream else
                                  not out.finished and len(out.new_token_ids) < self.stream_interval):
                live.held[i] = out
                return
            outs = {i: out}
            if not live.stream:  # the end: every completion's held output goes with it
                outs.update(live.held)
                live.held.clear()
            live.answered = live.answered or bool(out.new_token_ids)
            entry = live.waiting
            if entry is not None and (live.backlog >= self.max_backlog or not live.stream):
                for j, o in outs.items():
                    entry.outs[j] = merge_outputs(entry.outs.get(j), o) if live.stream else o
                entry.t_last = now
                self.num_coalesced += 1
                return
            entry = live.waiting = _Entry(live, outs, now)
            live.backlog += 1
            self._queued += 1
            self.max_queued = max(self.max_queued, self._queued)
        self._queue.put(entry)

    def queue_depth(self) -> int:
        """Outputs waiting for the responder."""
        with self._pending_lock:
            return self._queued

    # -- the responder thread ----------------------------------------------------------------------
    def _run(self) -> None:
        last_poll = time.monotonic()
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
                    item.live.backlog -= 1
                    if item.live.waiting is item:
                        item.live.waiting = None
                try:
                    self._handle(item.live, item.outs, item.t_first, item.t_last)
                except Exception:
                    log.exception("responding failed")
            now = time.monotonic()
            if now - last_poll >= self.poll_interval:
                last_poll = now
                self._poll_cancelled()
                if self.stop_file is not None and not self._closing and self.stop_file.exists():
                    self.abort_all()
                self._check_engine()

    def _check_engine(self) -> None:
        failure = getattr(self.engine, "failure", None)
        if failure and not self._failure_reported and self.on_engine_failure is not None:
            self._failure_reported = True
            try:
                self.on_engine_failure(failure)
            except Exception:
                log.exception("reporting the engine's failure failed")

    def _handle(self, live: Live, outs: dict, t_first: float, t: float) -> None:
        if live.done:
            return
        live.latest.update(outs)
        ended = [o.finish_reason for o in live.latest.values() if o.finished]
        finished = len(ended) == live.n or "error" in ended
        now = time.monotonic()
        if not finished and not live.cancelled and now - live.last_cancel_check >= self.cancel_interval:
            live.last_cancel_check = now
            if _is_cancelled(live.sender):
                live.cancelled = True
                self.engine.abort(live.key)
        # Tokens per completion since the last output handled here (completions step together).
        new = 0
        for i, out in outs.items():
            new = max(new, len(out.token_ids) - live.tokens_seen.get(i, 0))
            live.tokens_seen[i] = len(out.token_ids)
        # Merged outputs carry several tokens: each token after the first is one inter-token sample
        # of the mean gap, so the histogram counts tokens however the responses were merged.
        if new > 0:
            if live.last_token_time is None:
                self.metrics_writer.add("ttft", t_first - live.arrival)
                self.metrics_writer.poke()  # it is running now: the gauges show it without waiting
                queued = next((o.queue_seconds for o in outs.values() if o.queue_seconds is not None), None)
                if queued is not None:  # arrival to first scheduled, in the engine
                    self.metrics_writer.add("queue", queued)
                since, new = t_first, new - 1
            else:
                since = live.last_token_time
            if new > 0:
                self.metrics_writer.add("itl", (t - since) / new, new)
            live.last_token_time = t
        if finished:
            self._finish(live, outs, t)
        elif live.stream and not live.cancelled:
            self.respond(live.sender, output_tensors(live, outs, self._detok), None, False)

    def _finish(self, live: Live, outs: dict, t: float) -> None:
        live.done = True
        with self._lock:
            self._live.pop(live.key, None)
        self.metrics_writer.poke()
        self.metrics_writer.add("e2e", t - live.arrival)
        failed = next((o for o in live.latest.values() if o.finish_reason == "error"), None)
        if live.cancelled:  # nobody listens: just close the request
            self.respond(live.sender, None, None, True)
        elif failed is not None:  # refused after arrival (its constraint) or failed by the engine
            code = {"invalid": "INVALID_ARG", "unavailable": "UNAVAILABLE"}.get(getattr(failed, "error_kind", None),
                                                                                     "INTERNAL")
            self.respond(live.sender, None, Error(failed.error or "the engine failed this request", code), True)
        else:
            self.respond(live.sender, output_tensors(live, outs, self._detok), None, True)

    def _encode(self, text: str) -> list[int]:
        tok = getattr(self.engine, "tokenizer", None)
        if tok is None:
            raise ValueError("embedding_bias_words needs a tokenizer: this checkpoint has no tokenizer.json")
        return tok.encode(text, add_special_tokens=False)

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
        self.metrics_writer.close()
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
