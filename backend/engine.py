"""The engine: one step is schedule -> run -> postprocess.

`LLMEngine` is single-threaded and synchronous (the offline `LLM` drives it directly).
`AsyncEngine` (async_engine.py) runs it on its own thread for the server.

In the request-level batching modes (static, dynamic) a batch answers when it ends, as a server
running one padded `generate` call per batch does: each member's outputs are held and delivered
as one final output when the scheduler releases the batch (an abort or an error still answers at
once).
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import Optional, Union

from backend.block_manager import BlockManager
from backend.config import EngineConfig
from backend.loader import load_model_config
from backend.outputs import RequestOutput, StopStringMatcher, merge_outputs
from backend.request import Request, RequestStatus, SamplingParams
from backend.runner import ModelRunner
from backend.scheduler import Scheduler
from backend.tokenizer import IncrementalDetokenizer, Tokenizer

log = logging.getLogger(__name__)
Prompt = Union[str, list[int]]


class QueueFullError(RuntimeError):
    """The waiting queue holds max_queue_size requests already (retry later)."""


class EngineDeadError(RuntimeError):
    """The engine is shut down, or stopped after an internal error it could not recover from."""


class LLMEngine:
    def __init__(self, config: EngineConfig):
        if not config.model_path:
            raise ValueError("model_path is required (a Hugging Face checkpoint directory)")
        self.config = config
        self.model_config = load_model_config(config.model_path)
        self.max_model_len = self._max_model_len()
        self.tokenizer = Tokenizer.from_dir(config.model_path)
        self.max_input_bytes = config.max_input_bytes or self._derived_max_input_bytes()
        self.runner = ModelRunner(config, self.model_config, self.max_model_len)
        self.blocks = BlockManager(self.runner.num_blocks, config.kv_block_size,
                                   enable_prefix_caching=config.enable_kv_cache_reuse)
        self.scheduler = Scheduler(config, self.blocks, self.max_model_len)
        self._detok: dict[str, tuple[Optional[IncrementalDetokenizer], StopStringMatcher]] = {}
        self._held: dict[str, RequestOutput] = {}  # padded batches: outputs kept until the batch ends
        self.idle = True  # the last step ran nothing (a batching gate is holding requests back)
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0

    def _max_model_len(self) -> int:
        limit = self.model_config.max_position_embeddings
        if self.model_config.sliding_window:  # beyond the window we would attend where HF does not
            limit = min(limit, self.model_config.sliding_window)
        if self.config.max_model_len == 0:
            return limit
        if self.config.max_model_len > limit:
            raise ValueError(f"max_model_len ({self.config.max_model_len}) exceeds what the model "
                             f"supports ({limit})")
        return self.config.max_model_len

    def _derived_max_input_bytes(self) -> int:
        """4 x max_model_len x the longest token in bytes: each token covers at most that many bytes of
        text, so a longer text cannot fit in max_model_len tokens (x4 leaves room for normalizers
        that shrink text). It lets a 10 MB prompt be refused before it is tokenized."""
        if self.tokenizer is None:
            return 4 * self.max_model_len * 16
        vocab = self.tokenizer.backend.get_vocab(with_added_tokens=True)
        longest = max((len(t.encode("utf-8")) for t in vocab), default=16)
        return 4 * self.max_model_len * max(longest, 1)

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    # -- requests -------------------------------------------------------------------------------
    def make_request(self, request_id: str, prompt: Prompt, params: SamplingParams,
                     arrival_time: Optional[float] = None) -> Request:
        """Tokenize and check a request against every limit; raises ValueError saying which."""
        params.validate()
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this checkpoint has no tokenizer.json: send input_ids instead of text")
            if len(prompt) * 4 > self.max_input_bytes and len(prompt.encode("utf-8")) > self.max_input_bytes:
                raise ValueError(f"the prompt is {len(prompt.encode('utf-8'))} bytes; the limit is "
                                 f"{self.max_input_bytes} bytes (max_input_bytes; max_model_len is "
                                 f"{self.max_model_len} tokens)")
            ids = self.tokenizer.encode(prompt)
        else:
            if len(prompt) > self.max_model_len:
                raise ValueError(f"prompt has {len(prompt)} tokens; max_model_len is {self.max_model_len}")
            ids = [int(t) for t in prompt]
            bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise ValueError(f"input_ids: token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        if not ids:
            raise ValueError("the prompt is empty: send at least one token")
        if len(ids) > self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens; max_model_len is {self.max_model_len}")
        self.scheduler.check_fits(len(ids), params.max_tokens)
        eos = self.model_config.eos_token_ids
        if not eos and self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos = (self.tokenizer.eos_token_id,)
        return Request(request_id, ids, params, eos, arrival_time)

    def check_queue(self, pending: int = 0) -> None:
        limit = self.config.max_queue_size
        if limit and len(self.scheduler.waiting) + pending >= limit:
            raise QueueFullError(f"queue full: {limit} requests are waiting (max_queue_size); retry later")

    def add(self, request: Request) -> None:
        self.scheduler.add(request)
        detok = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids) if self.tokenizer else None
        self._detok[request.request_id] = (detok, StopStringMatcher(request.params.stop))
        self.prompt_tokens_total += request.num_prompt_tokens

    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams) -> Request:
        self.check_queue()
        request = self.make_request(request_id, prompt, params)
        self.add(request)
        return request

    def abort(self, request_id: str) -> Optional[RequestOutput]:
        request = self.scheduler.abort(request_id)
        if request is None:
            return None
        held = self._held.pop(request_id, None)
        if request_id not in self._detok:  # it had finished and was waiting for its batch to end
            if held is None:
                held = RequestOutput(request_id, request.prompt_token_ids, [], list(request.output_token_ids),
                                     "", "", True, None)
            return dataclasses.replace(held, finished=True, finish_reason=request.finish_reason)
        return merge_outputs(held, self._output(request, []))

    def has_work(self) -> bool:
        return self.scheduler.has_work

    # -- one step -------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        now = time.monotonic()
        out = self.scheduler.schedule(now)
        self.idle = out.is_empty
        if out.is_empty:
            results = []
        else:
            results = self._run(out)
        return self._batch_outputs(results) if self.scheduler.gate.pads else results

    def _run(self, out) -> list[RequestOutput]:
        try:
            sampled = self.runner.run(out, self.blocks)
        except Exception as exc:  # a failed step fails its own requests, not the engine
            log.exception("model step failed")
            return self._fail([s.request for s in out.seqs], f"model step failed: {exc!r}")
        self.scheduler.postprocess(out, sampled, time.monotonic())
        self.generation_tokens_total += len(sampled)
        results = []
        for seq in out.seqs:
            req = seq.request
            if req.request_id in sampled:
                results.append(self._output(req, [sampled[req.request_id]]))
        return results

    def _batch_outputs(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Padded batches: hold each member's outputs, merged, until the scheduler releases the
        batch; aborts and errors answer at once."""
        ready = []
        for o in outputs:
            merged = merge_outputs(self._held.pop(o.request_id, None), o)
            if o.finished and o.finish_reason in ("abort", "error"):
                ready.append(merged)
            else:
                self._held[o.request_id] = merged
        ready.extend(self._held.pop(r.request_id) for r in self.scheduler.pop_released()
                     if r.request_id in self._held)
        return ready

    def _fail(self, requests: list[Request], message: str) -> list[RequestOutput]:
        results = []
        for req in requests:
            if not req.status.finished:
                req.error = message
                self.scheduler.finish(req, RequestStatus.FINISHED_ERROR)
            results.append(self._output(req, []))
        return results

    def fail_running(self, message: str) -> list[RequestOutput]:
        """After an unexpected exception in a step outside the model run (in scheduling or
        postprocessing): fail the requests of the batch (the running ones), keep the waiting ones,
        and check that the block and queue state is still sound (raises if it is not)."""
        results = []
        for req in list(self.scheduler.running) + list(self.scheduler.lingering):
            self._held.pop(req.request_id, None)
            req.error = message
            self.scheduler.finish(req, RequestStatus.FINISHED_ERROR)
            results.append(self._closing_output(req))
        self.check_integrity()
        return results

    def _closing_output(self, req: Request) -> RequestOutput:
        """The final output of a finished request, whatever state its detokenizer is in."""
        self._detok.pop(req.request_id, None)
        self.runner.sampler.forget(req.request_id)
        return RequestOutput(req.request_id, req.prompt_token_ids, [], list(req.output_token_ids), "", "",
                             True, req.finish_reason, req.error)

    def _output(self, req: Request, new_ids: list[int]) -> RequestOutput:
        """Detokenize new tokens, apply stop strings, and package what the caller sees."""
        detok, stops = self._detok[req.request_id]
        delta = ""
        if detok is not None:
            delta = detok.add(new_ids) if new_ids else ""
            if req.status.finished:
                delta += detok.flush()
        if stops.feed(delta) and not req.status.finished:
            self.scheduler.finish(req, RequestStatus.FINISHED_STOPPED)
        if req.status.finished:
            del self._detok[req.request_id]
            self.runner.sampler.forget(req.request_id)
        new_text = stops.emit(final=req.status.finished)
        return RequestOutput(req.request_id, req.prompt_token_ids, new_ids, list(req.output_token_ids),
                             new_text, stops.emitted, req.status.finished, req.finish_reason, req.error)

    def stats(self) -> dict[str, Union[int, float]]:
        b = self.blocks
        return {
            # members of a padded batch that finished still hold their slot until the batch ends
            "num_requests_running": len(self.scheduler.running) + len(self.scheduler.lingering),
            "num_requests_waiting": len(self.scheduler.waiting),
            "kv_blocks_total": b.num_blocks,
            "kv_blocks_used": b.num_used_blocks,
            "kv_blocks_free": b.num_free_blocks,
            "kv_cache_usage_ratio": b.num_used_blocks / b.num_blocks,
            "num_preemptions": self.scheduler.num_preemptions,
            "prefix_cache_hit_tokens": self.scheduler.prefix_hit_tokens,
            "prompt_tokens_total": self.prompt_tokens_total,
            "generation_tokens_total": self.generation_tokens_total,
        }

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()
