"""A response's output tensors, as the vLLM backend's additional-outputs contract shapes them
(its docs/additional_outputs.md and src/model.py), and the metrics writer: every metric IPC
(the responder's histogram samples, the engine's gauges) on a thread of its own. No Triton imports: unit-tested without a server."""
from __future__ import annotations

import collections
import json
import logging
import math
import threading
import time
from typing import Any, Callable, Mapping, Optional

import numpy as np

from pooling_door import pooled_tensors

log = logging.getLogger("inflight.triton")


def _logprobs_json(logprobs: Optional[list]) -> bytes:
    """The vLLM backend's `logprobs` output for one completion: per token, token id -> its
    logprob, rank and text; `null` when the request did not ask for logprobs. (Also the
    `prompt_logprobs` output, whose first entry is null.)"""
    if logprobs is None:
        return b"null"
    return json.dumps([None if step is None else
                       {str(tid): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
                        for tid, lp in step.items()} for step in logprobs]).encode("utf-8")


def _split(live: Any, i: int, out: Any, last: Any, text: str, prompt_ids_text: Callable) -> tuple[str, str]:
    """(thinking, answer) of completion i's text by the request's reasoning_parser
    (openai_server/reasoning.py): streaming, of this response's piece, one parser per completion
    holding back what may be a tag; else of the whole output."""
    from openai_server.reasoning import ReasoningParser, prompt_state

    parser = live.splitters.get(i) if live.stream else None
    if parser is None:
        first = out or last
        prompt = live.prompt_text if live.prompt_text is not None else \
            prompt_ids_text(list(first.prompt_token_ids[-8:])) if first is not None else ""
        parser = ReasoningParser(live.reasoning, prompt_state(prompt))
        if live.stream:
            live.splitters[i] = parser
    thought, answer = parser.feed(text)
    if not live.stream or (last is not None and last.finish_reason is not None):
        more = parser.finish()
        thought, answer = thought + more[0], answer + more[1]
    return thought, answer


def output_tensors(live: Any, outs: Mapping[int, Any], prompt_ids_text: Callable[[list[int]], str]) -> dict[str, np.ndarray]:
    """The output tensors of one response, as the vLLM backend shapes them: one entry per
    completion. Streaming: each completion's new tokens (none for one without an output in this
    response); otherwise all of them, with the prompt in front unless exclude_input_in_output.
    text_output (and output_ids for n = 1 or beam search) always; the others only when asked for.
    `live` is the request's live_request.Live: n, stream, exclude_input, returns and, per completion,
    its newest output (`latest`)."""
    first = live.latest.get(0)
    if getattr(first, "pooled", None) is not None:  # a pooling request's one answer (pooling_door.py)
        return pooled_tensors(first)
    texts, ids_, new_counts, reasons, cumulative, logprobs, thoughts, token_lps = [], [], [], [], [], [], [], []
    for i in range(live.n):
        out = outs.get(i) if live.stream else live.latest.get(i)
        last = live.latest.get(i, out)
        if out is None:
            text, ids, lps = "", [], ([] if last is not None and last.logprobs is not None else None)
        elif live.stream:
            text, ids, lps = out.new_text, list(out.new_token_ids), out.new_logprobs
        else:
            text, ids, lps = out.text, list(out.token_ids), out.logprobs
        token_lps.append([step[t].logprob for t, step in zip(ids, lps or [])])  # the sampled tokens'
        if live.reasoning is not None:
            thought, text = _split(live, i, out, last, text, prompt_ids_text)
            thoughts.append(thought.encode("utf-8"))
        if out is not None and not live.stream:
            if not live.exclude_input:
                prompt = live.prompt_text if live.prompt_text is not None else prompt_ids_text(out.prompt_token_ids)
                text, ids = prompt + text, list(out.prompt_token_ids) + ids
        texts.append(text.encode("utf-8"))
        ids_.append(ids)
        new_counts.append(len(out.new_token_ids if live.stream else out.token_ids) if out is not None else 0)
        reasons.append(str(last.finish_reason if last is not None else None).encode())
        cum = last.cumulative_logprob if last is not None else None
        cumulative.append(math.nan if cum is None else cum)
        logprobs.append(_logprobs_json(lps))
    tensors = {"text_output": np.array(texts, dtype=np.object_)}
    if live.reasoning is not None:
        tensors["reasoning_output"] = np.array(thoughts, dtype=np.object_)
    if live.n == 1:
        tensors["output_ids"] = np.array(ids_[0], dtype=np.int32)
    elif live.beams:  # TensorRT-LLM's [beam, tokens], best first; the shorter beams padded with -1
        longest = max(len(ids) for ids in ids_)
        tensors["output_ids"] = np.array([ids + [-1] * (longest - len(ids)) for ids in ids_], dtype=np.int32)
    asked = live.returns
    if "return_finish_reason" in asked:
        tensors["finish_reason"] = np.array(reasons, dtype=np.object_)
    if "return_cumulative_logprob" in asked:
        tensors["cumulative_logprob"] = np.array(cumulative, dtype=np.float32)
    if "return_log_probs" in asked:  # TensorRT-LLM's: [completions] and [completions, tokens], padded with 0
        tensors["cum_log_probs"] = np.array(cumulative, dtype=np.float32)
        longest = max(len(row) for row in token_lps)
        tensors["output_log_probs"] = np.array([row + [0.0] * (longest - len(row)) for row in token_lps],
                                               dtype=np.float32).reshape(len(token_lps), longest)
    if "return_logprobs" in asked:
        tensors["logprobs"] = np.array(logprobs, dtype=np.object_)
    if "return_num_input_tokens" in asked:
        first = next((o for o in live.latest.values()), None)
        tensors["num_input_tokens"] = np.array([len(first.prompt_token_ids) if first else 0], dtype=np.uint32)
    if "return_num_output_tokens" in asked:
        tensors["num_output_tokens"] = np.array(new_counts, dtype=np.uint32)
    if "return_prompt_logprobs" in asked:  # the request's (its first completion's), with its first tokens
        first = outs.get(0) if live.stream else live.latest.get(0)
        with_first = first is not None and (not live.stream or len(first.token_ids) == len(first.new_token_ids))
        prompt = getattr(first, "prompt_logprobs", None) if with_first else None
        tensors["prompt_logprobs"] = np.array([_logprobs_json(prompt)], dtype=np.object_)
    if "return_num_cached_tokens" in asked:
        first = live.latest.get(0)
        tensors["num_cached_tokens"] = np.array([first.num_cached_tokens if first else 0], dtype=np.uint32)
    if "return_queue_info" in asked:
        first = outs.get(0) if live.stream else None
        queue = getattr(first, "queue", None) or getattr(live.latest.get(0), "queue", None)
        if queue is not None:
            tensors.update(queue_tensors(queue))
    return tensors


# Engine times are time.monotonic() seconds; clients get Unix nanoseconds, as TensorRT-LLM's timing outputs.
_UNIX_NS_AT_MONOTONIC_ZERO = time.time_ns() - time.monotonic_ns()


def _unix_ns(t: Optional[float]) -> int:
    return 0 if t is None else _UNIX_NS_AT_MONOTONIC_ZERO + int(t * 1e9)


def queue_tensors(q: Any) -> dict[str, np.ndarray]:
    """The `return_queue_info` outputs of a backend.core.outputs.QueueInfo."""
    def one(value, dtype):
        return np.array([value], dtype=dtype)
    return {
        "queue_position": one(q.position, np.int32),
        "reserved_step": one(-1 if q.reserved_step is None else q.reserved_step, np.int64),
        "engine_step": one(q.engine_step, np.int64),
        "first_scheduled_step": one(-1 if q.first_scheduled_step is None else q.first_scheduled_step, np.int64),
        "kv_blocks_reserved": one(q.kv_blocks_reserved, np.uint32),
        "arrival_time_ns": one(_unix_ns(q.arrival_time), np.int64),
        "first_scheduled_time_ns": one(_unix_ns(q.first_scheduled_time), np.int64),
        "first_token_time_ns": one(_unix_ns(q.first_token_time), np.int64),
        "finished_time_ns": one(_unix_ns(q.finished_time), np.int64),
        "seconds_since_arrival": one(time.monotonic() - q.arrival_time, np.float64),
        "expected_wait_seconds": one(-1.0 if q.expected_wait_seconds is None else q.expected_wait_seconds, np.float64),
    }


# Histogram samples are written for at most this share of the interval between two updates of the
# gauges: a bound in time, not in samples, since one sample is one IPC and under load an IPC took
# long enough that 256 of them held the gauges back for the whole of a test's requests (a two-engine
# server's instance read 0 running while it ran three requests).
FLUSH_SHARE = 0.5


class MetricsWriter:
    """Every metric IPC, on a thread of its own: histogram samples (queued by the responder) and
    the engine's gauges and counters (every `interval`, and at once when poked). Each observation
    or set of a Triton custom metric is an IPC round trip to the server (pb_utils has no
    observe-many), and the inter-token histogram takes one per token: queued here, they cost the
    responder an append. One thread also keeps the metric IPC from ever running concurrently."""

    def __init__(self, metrics: Any, interval: float, stats: Optional[Callable[[], Mapping[str, float]]] = None):
        self.metrics = metrics
        self.interval = interval
        self.stats = stats
        self._pending: collections.deque = collections.deque()  # (kind, seconds, count)
        self._wake = threading.Event()
        self._closed = False
        # The first report now, on the caller's thread (model.py's initialize): the series made at the
        # engine's first report of them (the KV tiers') exist with their values before the model is
        # ready, so no scrape of a ready server misses one or reads one half made (a test once read
        # the host tier's fill before the disk tier's series was made: a KeyError).
        self._report()
        self._thread = threading.Thread(target=self._run, name="inflight-metrics", daemon=True)
        self._thread.start()

    def add(self, kind: str, seconds: float, count: int = 1) -> None:
        self._pending.append((kind, seconds, count))

    def poke(self) -> None:
        """The engine's figures changed (a request arrived or ended): write them now."""
        self._wake.set()

    def flush(self, until: Optional[float] = None) -> None:
        """Write the queued histogram samples (all, or those that `time.monotonic()` reaches `until` on)."""
        while self._pending and (until is None or time.monotonic() < until):
            kind, seconds, count = self._pending.popleft()
            try:
                for _ in range(count):
                    self.metrics.observe(kind, seconds)
            except Exception:
                log.exception("metrics observe failed")

    def _run(self) -> None:
        while not self._closed:
            self._wake.wait(self.interval)
            self._wake.clear()
            # the gauges first, then a bounded share of the samples: under load the samples (one IPC
            # each, one per token for the inter-token histogram) fall behind, and the gauges a
            # scraper or an autoscaler reads must not wait behind them
            self._report()
            self.flush(until=time.monotonic() + FLUSH_SHARE * self.interval)
            if self._pending:
                self._wake.set()

    def _report(self) -> None:
        """The engine's gauges and counters as of now."""
        if self.stats is not None:
            try:
                self.metrics.update(self.stats())
            except Exception:
                log.exception("metrics update failed")

    def close(self, timeout: float = 5.0) -> None:
        self._closed = True
        self._wake.set()
        self._thread.join(timeout)
        self.flush()


def lora_info_labels(lora_requests: Mapping[str, Mapping[str, int]], max_loras: int) -> dict[str, str]:
    """The labels of vLLM's `lora_requests_info` info gauge (the inference gateway's LoRA metric,
    docs/gateway.md) from the engine's per-adapter counts: max_lora, and the adapters with a running
    request and those with a waiting one, comma-joined as vLLM joins them."""
    def with_(state: str) -> str:
        return ",".join(sorted(name for name, counts in lora_requests.items() if counts.get(state)))
    return {"max_lora": str(max_loras), "running_lora_adapters": with_("running"),
            "waiting_lora_adapters": with_("waiting")}
