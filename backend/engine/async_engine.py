"""`AsyncEngine`: an `LLMEngine` on threads of its own, for the server. Requests arrive from any
thread, outputs leave through per-request callbacks, aborts take effect before the next step.

Two threads: the engine thread runs the core's steps (schedule -> run -> update: token ids only)
and hands each step's outputs to the output thread, which makes them text (detokenizing, stop
strings, logprob texts: output_processor.py) and calls the callbacks while the next step runs. A
stop string ends its sequence there at once; the engine thread is told, and finishes it in the
scheduler before the step after next at the latest: it never starts a step while the outputs of
more than one step are still being made text. So the engine thread never detokenizes, and a
sequence a stop string ended costs at most one step more.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from typing import Callable, Optional, Union

from backend.core.config import EngineConfig
from backend.core.errors import EngineDeadError
from backend.core.lora import LoRALike
from backend.core.outputs import CoreOutput, RequestOutput
from backend.core.sampling_params import SamplingParams
from backend.core.request import Request, RequestStatus
from backend.engine.llm_engine import LLMEngine, Prompt
from backend.worker.cpu_affinity import team_placement

log = logging.getLogger(__name__)

OutputCallback = Callable[[RequestOutput], None]


class AsyncEngine:
    """LLMEngine on its own threads. add_request validates in the caller's thread (raising
    ValueError or QueueFullError) and queues; the engine thread admits and steps; the output
    thread makes text and calls back. cpu_placement: the CPU team's cores per thread (issue 47)."""

    def __init__(self, config: EngineConfig):
        self._lock = threading.Condition()
        self._new: deque[Request] = deque()
        self._aborts: deque[str] = deque()
        self._stops: deque[tuple[str, int]] = deque()  # sequences a stop string ended (output thread)
        self._callbacks: dict[str, OutputCallback] = {}
        self._open: dict[str, int] = {}
        self._stopped = False
        self._broken: Optional[str] = None  # why the loop stopped after a fault it could not recover from
        self._lost: Optional[str] = None  # a tensor-parallel rank died (reported from its watch thread)
        self._delivery: queue.Queue = queue.Queue()  # the engine thread's outputs, for the output thread
        self._posted = self._processed = 0  # steps' outputs handed to the output thread, and made text
        # The engine is built on its own thread, the one that runs every step: torch keeps an OpenMP
        # thread pool per calling thread, and a model loaded on one thread and stepped on another
        # leaves two pools contending for the cores (each step took about 2x as long on 2 cores).
        self.engine: LLMEngine
        self._stats: dict[str, Union[int, float]]  # a consistent snapshot, taken between steps
        self._build_error: Optional[BaseException] = None
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(config, ready), name="inflight-engine", daemon=True)
        self._output_thread = threading.Thread(target=self._output_loop, name="inflight-output", daemon=True)
        self._thread.start()
        ready.wait()
        if self._build_error is not None:
            raise self._build_error
        self._output_thread.start()

    tokenizer = property(lambda self: self.engine.tokenizer)
    vocab_size = property(lambda self: self.engine.vocab_size)
    max_model_len = property(lambda self: self.engine.max_model_len)
    max_input_bytes = property(lambda self: self.engine.max_input_bytes)
    device = property(lambda self: self.engine.runner.device)  # where it runs, index included (cuda:1)

    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams,
                    on_output: OutputCallback, priority: int = 0, queue_info: bool = False,
                    lora_request: LoRALike = None, pooling=None) -> None:  # pooling: PoolingParams (docs/pooling.md)
        request = self.engine.make_request(request_id, prompt, params, priority=priority, queue_info=queue_info,
                                           lora_request=lora_request, pooling=pooling)
        with self._lock:
            if self._broken is not None:
                raise EngineDeadError(f"the engine stopped after an internal error ({self._broken}); "
                                      "restart the server")
            if self._stopped:
                raise EngineDeadError("the engine is shut down")
            if request_id in self._callbacks:
                raise ValueError(f"request_id '{request_id}' is already running; use a new id")
            self.engine.loras.check_open(request.lora_name)  # its adapter began unloading since it resolved
            self.engine.check_queue(len(self._new), request)
            self._callbacks[request_id] = on_output
            self._open[request_id] = request.params.n  # completions still to finish
            self.engine.outputs.add(request)  # before the engine can output for it
            self._new.append(request)
            self._lock.notify()

    def abort(self, request_id: str) -> bool:
        with self._lock:
            known = request_id in self._callbacks
            if known:
                self._aborts.append(request_id)
                self._lock.notify()
            return known

    def load_lora(self, name: str, path: str) -> None:
        """Load an adapter at run time (checked as at start; ValueError saying why not)."""
        self.engine.loras.load(name, path)

    def unload_lora(self, name: str) -> threading.Event:
        """Begin unloading an adapter (ValueError if not loaded): new requests naming it are refused,
        its running ones finish; the event is set once it is unloaded and its slot free."""
        done = self.engine.loras.begin_unload(name)
        self._wake()
        return done

    @property
    def failure(self) -> Optional[str]:
        """Why the engine stopped serving (a fault it could not recover from, a lost tensor-parallel
        rank); None while it serves."""
        return self._broken

    def stats(self) -> dict[str, Union[int, float]]:
        """The engine's figures as of the end of its last step (never half-way through one), and
        the tokens and pooled requests delivered so far (counted on the output thread, after the
        step's snapshot: else the last request's count would wait for a step that may never come)."""
        outputs = self.engine.outputs
        return {**self._stats, "generation_tokens_total": outputs.generation_tokens_total,
                "pooling_requests_total": outputs.pooling_requests_total,
                "pooling_prompt_tokens_total": outputs.pooling_tokens_total,
                **self.engine.rejections()}  # refused at arrival: counted on the callers' threads

    def shutdown(self, timeout: float = 10.0) -> None:
        with self._lock:
            self._stopped = True
            self._lock.notify()
        self._thread.join(timeout)
        self._output_thread.join(timeout)

    # -- the engine thread ------------------------------------------------------------------------
    def _run(self, config: EngineConfig, ready: threading.Event) -> None:
        try:
            self.engine = LLMEngine(config)
            self._stats = self.engine.stats()
            self.cpu_placement: list[list[int]] = team_placement() if self.device.type == "cpu" else []
        except BaseException as exc:  # raised again in __init__, on the caller's thread
            self._build_error = exc
            return
        finally:
            ready.set()
        self.engine.waitlist.on_ready = self._wake  # a compiled grammar: its request can be queued
        if (tp := getattr(self.engine.runner, "tp", None)) is not None:
            tp.on_failure(self._rank_lost)
        try:
            self._loop()
        finally:
            self.engine.close()
            self.engine.waitlist.on_ready = None  # the cycle back to us: a dropped engine is freed at once
            self._delivery.put(None)  # the output thread ends once it has delivered everything

    def _settle_loras(self) -> None:
        """Unload the draining adapters nothing holds (under the lock: the queued requests count)."""
        if self.engine.loras.draining and self.engine.loras.settle([*self._new, *self.engine.waitlist]):
            self._stats = self.engine.stats()  # the metrics see the unload without waiting for a step

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
                self._settle_loras()
                while (not self._stopped and not self._new and not self._aborts and not self._stops
                       and not self.engine.has_runnable_work() and not self.engine.tiers_settling()
                       and self._lost is None):
                    self._lock.wait()
                    self._settle_loras()
                # at most one step's outputs still being made text: a stop string they hold is known
                # before the step after next
                while self._processed < self._posted - 1 and not self._stopped and self._lost is None:
                    self._lock.wait()
                if self._stopped:
                    break
                lost = self._lost
                new, self._new = list(self._new), deque()
                aborts, self._aborts = list(self._aborts), deque()
                stops, self._stops = list(self._stops), deque()
            if lost is not None:  # no step can run any more: answer everyone, refuse new requests
                self._die(lost)
                return
            try:
                outputs = self._iterate(new, aborts, stops)
            except Exception as exc:  # the state is unsound: answer everyone, refuse new requests
                log.exception("the engine cannot recover; every request is failed")
                self._die(f"{type(exc).__name__}: {exc}")
                return
            self._stats = self.engine.stats()
            if self.engine.idle and not outputs and (self.engine.scheduler.has_work or self.engine.tiers_settling()):
                time.sleep(0.001)  # a batching gate holds requests back, or the KV tiers' jobs retire: poll gently
            if outputs:
                self._posted += 1
                self._delivery.put(outputs)
        self._drain()

    def _iterate(self, new: list[Request], aborts: list[str], stops: list[tuple[str, int]]) -> list[CoreOutput]:
        """One turn of the loop. A failed model run is handled inside the step (its requests fail);
        any other exception in a step fails the running batch here, and the loop carries on as long
        as the block and queue state checks out afterwards."""
        outputs = self.engine.stop(stops) if stops else []
        for request in new:
            try:
                self.engine.add(request)
            except Exception as exc:
                log.exception("adding request %s failed", request.request_id)
                request.error = f"{type(exc).__name__}: {exc}"
                request.status = RequestStatus.FINISHED_ERROR
                with self._lock:
                    self._open[request.request_id] = 1  # this one output ends it
                outputs.append(self.engine.final_output(request))
        for rid in aborts:
            outputs += self.engine.core_abort(rid)
        try:
            outputs += self.engine.core_step()
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
        self._delivery.put(("die", callbacks, reason))

    def _drain(self) -> None:
        """On shutdown every request still known gets a final 'abort' output."""
        with self._lock:
            new = list(self._new)
            self._new.clear()
        for request in new:
            self.engine.add(request)
        outputs = []
        held = [r.request_id for r in self.engine.waitlist] + [r.request_id for r in self.engine.scheduler.iter_requests()]
        for request_id in dict.fromkeys(held):  # compiling ones included
            outputs += self.engine.core_abort(request_id)
        self._stats = self.engine.stats()
        if outputs:
            self._delivery.put(outputs)

    # -- the output thread ------------------------------------------------------------------------
    def _output_loop(self) -> None:
        while True:
            item = self._delivery.get()
            if item is None:
                return
            if isinstance(item, tuple):  # the engine died
                _, callbacks, reason = item
                for request_id, callback in callbacks.items():
                    self._call(callback, RequestOutput(request_id, [], [], [], "", "", True, "error",
                                                       f"the engine failed: {reason}"))
                continue
            try:
                results, stopped = self.engine.outputs.process(item)
            except Exception:
                log.exception("making outputs failed")
                results, stopped = [], []
            with self._lock:
                self._stops.extend(stopped)
                self._processed += 1
                self._lock.notify()
            self._deliver(results)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            with self._lock:
                callback = self._callbacks.get(output.request_id)
                if output.finished:  # the request ends with its last completion (a refusal ends them all)
                    left = 0 if output.error_kind else self._open.get(output.request_id, 1) - 1
                    if left > 0:
                        self._open[output.request_id] = left
                    else:
                        self._open.pop(output.request_id, None)
                        self._callbacks.pop(output.request_id, None)
            if callback is not None and not self._call(callback, output) and not output.finished:
                self.abort(output.request_id)

    @staticmethod
    def _call(callback: OutputCallback, output: RequestOutput) -> bool:
        try:
            callback(output)
            return True
        except Exception:  # a broken client must not take the loop down
            log.exception("output callback for %s failed; aborting it", output.request_id)
            return False
