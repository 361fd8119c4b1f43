"""`AsyncEngine`: an `LLMEngine` on its own thread, for the server. Requests arrive from any thread,
outputs leave through per-request callbacks, aborts take effect before the next step."""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Callable, Optional, Union

from backend.core.config import EngineConfig
from backend.engine.llm_engine import LLMEngine, Prompt
from backend.core.errors import EngineDeadError
from backend.core.lora import LoRALike
from backend.core.outputs import RequestOutput
from backend.core.request import Request, RequestStatus, SamplingParams

log = logging.getLogger(__name__)

OutputCallback = Callable[[RequestOutput], None]


class AsyncEngine:
    """LLMEngine on its own thread. add_request validates in the caller's thread (raising
    ValueError or QueueFullError) and queues; the loop admits, steps and calls back."""

    def __init__(self, config: EngineConfig):
        self._lock = threading.Condition()
        self._new: deque[tuple[Request, OutputCallback]] = deque()
        self._aborts: deque[str] = deque()
        self._callbacks: dict[str, OutputCallback] = {}
        self._open: dict[str, int] = {}
        self._stopped = False
        self._broken: Optional[str] = None  # why the loop stopped after a fault it could not recover from
        self._lost: Optional[str] = None  # a tensor-parallel rank died (reported from its watch thread)
        # The engine is built on its own thread, the one that runs every step: torch keeps an OpenMP
        # thread pool per calling thread, and a model loaded on one thread and stepped on another
        # leaves two pools contending for the cores (each step took about 2x as long on 2 cores).
        self.engine: LLMEngine
        self._stats: dict[str, Union[int, float]]  # a consistent snapshot, taken between steps
        self._build_error: Optional[BaseException] = None
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(config, ready),
                                        name="inflight-engine", daemon=True)
        self._thread.start()
        ready.wait()
        if self._build_error is not None:
            raise self._build_error

    tokenizer = property(lambda self: self.engine.tokenizer)
    vocab_size = property(lambda self: self.engine.vocab_size)
    max_model_len = property(lambda self: self.engine.max_model_len)
    max_input_bytes = property(lambda self: self.engine.max_input_bytes)
    device = property(lambda self: self.engine.runner.device)  # where it runs, index included (cuda:1)

    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams,
                    on_output: OutputCallback, priority: int = 0, queue_info: bool = False,
                    lora_request: LoRALike = None) -> None:
        request = self.engine.make_request(request_id, prompt, params, priority=priority, queue_info=queue_info,
                                           lora_request=lora_request)
        with self._lock:
            if self._broken is not None:
                raise EngineDeadError(f"the engine stopped after an internal error ({self._broken}); "
                                      "restart the server")
            if self._stopped:
                raise EngineDeadError("the engine is shut down")
            if request_id in self._callbacks:
                raise ValueError(f"request_id '{request_id}' is already running; use a new id")
            self.engine.check_queue(len(self._new))
            self._callbacks[request_id] = on_output
            self._open[request_id] = params.n  # completions still to finish
            self._new.append((request, on_output))
            self._lock.notify()

    def abort(self, request_id: str) -> bool:
        with self._lock:
            known = request_id in self._callbacks
            if known:
                self._aborts.append(request_id)
                self._lock.notify()
            return known

    @property
    def failure(self) -> Optional[str]:
        """Why the engine stopped serving (a fault it could not recover from, a lost tensor-parallel
        rank); None while it serves."""
        return self._broken

    def stats(self) -> dict[str, Union[int, float]]:
        """The engine's figures as of the end of its last step (never half-way through one)."""
        return self._stats

    def shutdown(self, timeout: float = 10.0) -> None:
        with self._lock:
            self._stopped = True
            self._lock.notify()
        self._thread.join(timeout)

    # -- the loop -------------------------------------------------------------------------------
    def _run(self, config: EngineConfig, ready: threading.Event) -> None:
        try:
            self.engine = LLMEngine(config)
            self._stats = self.engine.stats()
        except BaseException as exc:  # raised again in __init__, on the caller's thread
            self._build_error = exc
            return
        finally:
            ready.set()
        self.engine.waitlist.on_ready = self._wake  # a compiled grammar: its request can be queued
        tp = getattr(self.engine.runner, "tp", None)
        if tp is not None:
            tp.on_failure(self._rank_lost)
        try:
            self._loop()
        finally:
            self.engine.close()

    def _wake(self) -> None:
        with self._lock:
            self._lock.notify()

    def _rank_lost(self, reason: str) -> None:
        with self._lock:
            self._lost = reason
            self._lock.notify()

    def _loop(self) -> None:
        while True:
            with self._lock:
                # A request whose grammar still compiles is no work yet: its compile's end wakes us.
                while (not self._stopped and not self._new and not self._aborts
                       and not self.engine.has_runnable_work() and self._lost is None):
                    self._lock.wait()
                if self._stopped:
                    break
                lost = self._lost
                new, self._new = list(self._new), deque()
                aborts, self._aborts = list(self._aborts), deque()
            if lost is not None:  # no step can run any more: answer everyone, refuse new requests
                self._die(lost)
                return
            try:
                outputs = self._iterate(new, aborts)
            except Exception as exc:  # the state is unsound: answer everyone, refuse new requests
                log.exception("the engine cannot recover; every request is failed")
                self._die(f"{type(exc).__name__}: {exc}")
                return
            self._stats = self.engine.stats()
            if self.engine.idle and not outputs and self.engine.scheduler.has_work:
                time.sleep(0.001)  # a batching gate is holding requests back; poll gently
            self._deliver(outputs)
        self._drain()

    def _iterate(self, new: list[tuple[Request, OutputCallback]], aborts: list[str]) -> list[RequestOutput]:
        """One turn of the loop. A failed model run is handled inside step() (its requests fail); any
        other exception in a step fails the running batch here, and the loop carries on as long as
        the block and queue state checks out afterwards."""
        outputs = []
        for request, _ in new:
            try:
                self.engine.add(request)
            except Exception as exc:
                log.exception("adding request %s failed", request.request_id)
                request.error = f"{type(exc).__name__}: {exc}"
                request.status = RequestStatus.FINISHED_ERROR
                with self._lock:
                    self._open[request.request_id] = 1  # this one output ends it
                outputs.append(self.engine.outputs.closing(request))
        for rid in aborts:
            outputs += self.engine.abort(rid)
        try:
            outputs += self.engine.step()
        except Exception as exc:
            log.exception("engine step failed; failing the running requests")
            outputs += self.engine.fail_running(f"engine step failed: {exc!r}")
        return outputs

    def _die(self, reason: str) -> None:
        """Answer every request with an error and refuse new ones (add_request raises)."""
        with self._lock:
            self._broken = reason
            callbacks, self._callbacks = dict(self._callbacks), {}
            self._open.clear()
            self._new.clear()
        for request_id, callback in callbacks.items():
            try:
                callback(RequestOutput(request_id, [], [], [], "", "", True, "error",
                                       f"the engine failed: {reason}"))
            except Exception:
                log.exception("output callback for %s failed", request_id)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            callback = self._callbacks.get(output.request_id)
            if output.finished:
                with self._lock:  # the request ends with its last completion (a refusal ends them all)
                    left = 0 if output.error_kind else self._open.get(output.request_id, 1) - 1
                    if left > 0:
                        self._open[output.request_id] = left
                    else:
                        self._open.pop(output.request_id, None)
                        self._callbacks.pop(output.request_id, None)
            if callback is None:
                continue
            try:
                callback(output)
            except Exception:  # a broken client must not take the loop down
                log.exception("output callback for %s failed; aborting it", output.request_id)
                if not output.finished:
                    self.abort(output.request_id)

    def _drain(self) -> None:
        """On shutdown every request still known gets a final 'abort' output."""
        with self._lock:
            new = list(self._new)
            self._new.clear()
        for request, _ in new:
            self.engine.add(request)
        outputs = []
        held = [r.request_id for r in self.engine.waitlist] + [r.request_id for r in self.engine.scheduler.iter_requests()]
        for request_id in dict.fromkeys(held):  # compiling ones included
            outputs += self.engine.abort(request_id)
        self._stats = self.engine.stats()
        self._deliver(outputs)
