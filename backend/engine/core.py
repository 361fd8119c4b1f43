"""The engine core: what runs on the engine thread. One step is schedule -> run -> update.

- schedule: the scheduler forms the batch over its live requests (backend/sched/), the speculator
  offers drafts to its decode rows, and the scheduler makes the step plan: new sequences once, then
  deltas by id, the grammar bitmask and the KV tiers' copies (backend/core/step.py);
- run: the worker (backend/worker/runner.py) applies the plan to its persistent batch, makes the
  copies, runs the model and samples;
- update: the scheduler appends what was sampled, ends sequences, frees blocks; the step's
  `CoreOutput`s (token ids and numbers) go out. Text is made on the delivery side
  (output_processor.py): the engine thread never detokenizes.
What the engine core holds is built by `build_core` (wiring.py); `LLMEngine` (llm_engine.py) adds
the requests' front: tokenizing, checks, and text.
"""
from __future__ import annotations

import logging
import time
from typing import Union

from backend.core.outputs import CoreOutput
from backend.core.request import Request, RequestStatus
from backend.core.step import StepResult
from backend.sched.step_cost import batch_shape
from backend.worker.vision import encoder_stats

log = logging.getLogger(__name__)


class EngineCore:
    """The engine thread's state and step (its parts: wiring.py)."""

    def add(self, request: Request) -> None:
        """Queue a made request and, when it asks for n > 1, its n - 1 sibling completions (the
        scheduler checks each as it queues it; all share the prompt and params, so the first
        refusal comes before any is queued). A request whose constraint compiles waits in the
        waitlist instead, and is queued by the step that finds its grammar ready."""
        if request.pending_grammar is not None:
            self.waitlist.add(request, request.pending_grammar)
            return
        if request.params.use_beam_search:  # its beams are its n sequences (backend/sched/beams.py)
            self.beams.start(request)
        family = [request] + [Request(request.request_id, request.prompt_token_ids, request.params,
                                      request.eos_token_ids, request.arrival_time, seed=request.seed,
                                      priority=request.priority, index=i) for i in range(1, request.params.n)]
        for seq in family:
            if seq.params.use_beam_search:
                self.beams.add(seq)
            seq.bad_words_ids = request.bad_words_ids
            seq.lora_name, seq.cache_salt = request.lora_name, request.cache_salt
            seq.mm_items = request.mm_items  # its images: the same placeholders, pixels and keys
            if seq is not request and request.grammar is not None:
                seq.grammar = request.grammar.sibling()  # each completion follows the grammar on its own
            self.scheduler.add(seq)
            self.queue.follow(seq)
        self.prompt_tokens_total += request.num_prompt_tokens

    def core_abort(self, request_id: str) -> list[CoreOutput]:
        """Abort every completion of the request; their final outputs (none if it is unknown)."""
        compiling = self.waitlist.remove(request_id)
        if compiling is not None:
            return self._deliver([self._end(compiling, RequestStatus.FINISHED_ABORTED)])
        return self._deliver([self.final_output(r) for r in self.scheduler.abort(request_id)])

    def stop(self, stopped: list[tuple[str, int]]) -> list[CoreOutput]:
        """Sequences a stop string ended on the delivery side: finished here (their final outputs
        only say so; the delivery side made the callers' already)."""
        ended = []
        for request_id, index in stopped:
            for req in self.scheduler.iter_requests():
                if req.request_id == request_id and req.index == index:
                    self.scheduler.finish(req, RequestStatus.FINISHED_STOPPED)
                    ended.append(self.final_output(req))
                    break
        return self._deliver(ended)

    def has_work(self) -> bool:  # anything unfinished, compiling constraints included
        return self.scheduler.has_work or len(self.waitlist) > 0

    def tiers_settling(self) -> bool:
        """The KV tiers still have copies or disk jobs in flight (or host slots pinned by them) with
        no request left: empty steps retire them (each polls the tiers)."""
        return not self.kv_tiers.idle and not self.scheduler.has_work

    def settle_tiers(self, timeout: float) -> bool:
        """Step until the tiers are idle (the disk writes of the last evictions retired) or timeout."""
        deadline = time.monotonic() + timeout
        while self.tiers_settling():
            if time.monotonic() > deadline:
                return False
            disk = getattr(self.kv_tiers, "disk", None)
            if disk is not None:
                disk.wait(0.005)  # until a job completes: no spinning
            self.core_step()  # an empty step: it polls the tiers (after has_work() is false, nothing else runs)
        return True

    def has_runnable_work(self) -> bool:
        """Something a step can do now: a request to schedule, or a compile that has ended."""
        return self.scheduler.has_work or self.waitlist.has_ready()

    # -- one step -------------------------------------------------------------------------------
    def core_step(self) -> list[CoreOutput]:
        refused = self._admit_compiled() if len(self.waitlist) else []
        batch = self.scheduler.schedule(time.monotonic())
        if self.speculator is not None and not batch.is_empty:  # decode rows may become verify rows
            self.speculator.propose(batch)
        plan = self.scheduler.plan(batch)
        plan.block_copies = self.beams.take_copies()
        self.idle = batch.is_empty
        started = time.perf_counter()
        try:
            result = self.runner.execute(plan)
        except Exception as exc:  # a failed step fails its own requests, not the engine
            log.exception("model step failed")
            if self.scheduler.tiers is not None:
                self.scheduler.tiers.abandon()
            return self._fail([s.request for s in batch.seqs], f"model step failed: {exc!r}", refused)
        if self.scheduler.tiers is not None:
            self.scheduler.tiers.issued(result.kv_copies, idle=batch.is_empty)
        if result.expert_tally:
            self.expert_tally = result.expert_tally
        if batch.is_empty:
            return self._deliver(refused)
        seconds, (rows, tokens, pairs, kv) = time.perf_counter() - started, batch_shape(batch)
        self.scheduler.observe_step(rows, tokens, pairs, seconds, kv)  # the step's cost on this device: the model learns
        self.drain.observe(rows, tokens, seconds)
        self.beams.take(result.sampled)  # the beams' numbers: chosen for below, never appended as sampled
        self.scheduler.postprocess(batch, result.sampled, time.monotonic())
        if self.speculator is not None:
            self.speculator.after_step(batch, result.sampled)
        self.drain.update(self.scheduler)  # read at arrival and by the queue reports (replayed on a change of counts)
        return self._deliver(refused + self._step_outputs(batch, result) + self.beams.advance())

    def _step_outputs(self, batch, result: StepResult) -> list[CoreOutput]:
        """Each sampling row's tokens: as many as the scheduler took (an EOS or a length limit may
        end a verify row's before its last)."""
        outputs = []
        for s in batch.seqs:
            sampled = result.sampled.get(s.request.seq_id)
            if sampled is None or s.taken < 0:  # (it ended while the step ran: its final output is out)
                continue
            req = s.request
            taken = sampled.tokens[:s.taken] if sampled.accepted else ([sampled] if s.taken else [])
            first = len(req.output_token_ids) == s.taken and taken and req.admitted_time is not None
            outputs.append(CoreOutput(
                req.request_id, req.index, [t.token for t in taken],
                [(t.logprob, t.rank, t.top) for t in taken] if sampled.logprob is not None else None,
                req.finish_reason, req.stop_token_id, req.error, num_cached_tokens=req.num_cached_tokens,
                queue_seconds=max(0.0, req.admitted_time - req.arrival_time) if first else None,
                prompt_logprobs=sampled.prompt_logprobs, pooled=req.pooled))
        return outputs

    def _admit_compiled(self) -> list[CoreOutput]:
        """Queue the requests whose grammar is ready; end those whose constraint was refused."""
        ready, refused = self.waitlist.take_compiled(self.grammars)
        for request in ready:
            self.add(request)
        return [self._end(request, RequestStatus.FINISHED_ERROR) for request in refused]

    def _end(self, request: Request, status: RequestStatus) -> CoreOutput:  # one that never reached the scheduler
        request.status, request.finished_time = status, time.monotonic()
        return self.final_output(request)

    @staticmethod
    def final_output(req: Request) -> CoreOutput:
        """A finished sequence's last output: no new tokens, its reason."""
        return CoreOutput(req.request_id, req.index, [], None, req.finish_reason, req.stop_token_id, req.error,
                          req.error_kind, req.num_cached_tokens)

    def _deliver(self, outputs: list[CoreOutput]) -> list[CoreOutput]:
        """What to hand out: the step's outputs with where followed requests stand, held back
        while a padded batch runs. Every way out of the engine passes here: the draft model's state
        of the requests that ended (stopped, aborted, failed) is dropped here too."""
        if self.speculator is not None:
            self.speculator.release_finished()
        self.kv_events.end_step()  # the step's changes to the prefix cache, as one batch of KV-cache events
        if self.beams.groups:  # beams that ended otherwise (aborted, failed): n final outputs
            outputs = self.beams.filter(outputs)
        return self.scheduler.deliver(self.queue.report(outputs))

    def _fail(self, requests: list[Request], message: str, earlier: list[CoreOutput] = ()) -> list[CoreOutput]:
        for req in requests:
            if not req.status.finished:
                req.error = message
                self.scheduler.finish(req, RequestStatus.FINISHED_ERROR)
        return self._deliver(list(earlier) + [self.final_output(req) for req in requests])

    def fail_running(self, message: str) -> list[CoreOutput]:
        """After an unexpected exception in a step outside the model run (in scheduling or
        postprocessing): fail the requests of the batch (those holding blocks), keep the waiting
        ones, and check that the block and queue state is still sound (raises if it is not)."""
        results = []
        for req in self.scheduler.holders():
            req.error = message
            self.scheduler.finish(req, RequestStatus.FINISHED_ERROR)
            results.append(self.final_output(req))
        self.check_integrity()
        return self._deliver(results)

    def stats(self) -> dict[str, Union[int, float]]:
        b = self.blocks
        return {
            # members of a padded batch that finished still hold their slot until the batch ends
            "num_requests_running": self.scheduler.num_running,
            "num_requests_waiting": len(self.scheduler.waiting) + len(self.waitlist),
            "num_requests_compiling": len(self.waitlist),  # of the waiting: their constraint compiles
            "kv_blocks_total": b.num_blocks,
            "kv_blocks_used": b.num_used_blocks,
            "kv_blocks_free": b.num_free_blocks,
            "kv_cache_usage_ratio": b.num_used_blocks / b.num_blocks,
            "kv_blocks_reserved": self.scheduler.policy.reserved_blocks(),  # a tally, kept as requests start and end
            "num_preemptions": self.scheduler.num_preemptions,
            "num_backfilled": self.scheduler.num_backfilled,
            "prefix_cache_hit_tokens": self.scheduler.prefix_hit_tokens,
            "prompt_tokens_total": self.prompt_tokens_total,
            "beam_requests_total": self.beams.requests_total,  # requests that ran beam search
            "num_beams_running": self.beams.num_running,  # beams of unfinished searches
            "lora_requests": self.loras.requests(),  # adapter -> {"running": n, "waiting": n}
            **self.loras.figures(),  # adapters loaded and unloaded at run time
            **(self.speculator.stats() if self.speculator else {}), **self.expert_tally, **self.kv_tiers.figures(),
            **self.kv_events.figures(),  # the KV-event publisher's drops, failures, bad requests
            **encoder_stats(self.runner),  # images: encoder runs, cache hits and bytes (docs/vision.md)
        }

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()
        for r in self.waitlist:
            assert self.blocks.num_blocks_of(r.seq_id) == 0, f"{r.seq_id} holds blocks while its grammar compiles"
        if self.speculator is not None:
            self.speculator.check_integrity()

    def close(self) -> None:
        """Release what outlives the object: the tensor-parallel ranks, the KV-event publisher, the KV tiers."""
        for part in (self.kv_events, self.kv_tiers, self.runner):
            part.close()
