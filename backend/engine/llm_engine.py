"""The engine: one step is schedule -> run -> postprocess -> outputs.

`LLMEngine` is single-threaded and synchronous (the offline `LLM` drives it directly). `AsyncEngine`
(async_engine.py) runs it on its own thread for the server. Who runs is the scheduler's (backend/sched/);
the model run is the runner's (runner.py, the only device-facing layer); text, stop strings and logprobs
are the output processor's, which returns the requests a stop string ended for the scheduler to finish.
"""
from __future__ import annotations

import logging
import random
import time
from typing import Optional, Union

from backend.kv.groups import KVCacheGroups
from backend.core.config import EngineConfig
from backend.core.errors import QueueFullError
from backend.core.input_guard import check_text, derived_max_input_bytes, int32
from backend.kv.event_publisher import attach_publisher
from backend.engine.kv_tiers import attach_kv_tiers
from backend.models.loader import load_model_config
from backend.engine.loras import EngineLoRAs
from backend.core.lora import LoRALike
from backend.engine.output_processor import OutputProcessor
from backend.engine.queue_report import QueueReporter
from backend.core.outputs import RequestOutput
from backend.core.request import Request, RequestStatus, SamplingParams
from backend.worker.runner import ModelRunner
from backend.sched.factory import make_scheduler
from backend.speculative.speculator import Speculator
from backend.engine.structured.compiler import ConstraintCompiler
from backend.sched.grammar_waitlist import GrammarWaitlist
from backend.text.tokenizer import Tokenizer

log = logging.getLogger(__name__)
Prompt = Union[str, list[int]]


class LLMEngine:
    def __init__(self, config: EngineConfig):
        if not config.model_path:
            raise ValueError("model_path is required (a Hugging Face checkpoint directory)")
        self.config = config
        self.model_config = load_model_config(config.model_path)
        self.max_model_len = self._max_model_len()
        self.tokenizer = Tokenizer.from_dir(config.model_path)
        self.max_input_bytes = config.max_input_bytes or derived_max_input_bytes(self.tokenizer, self.max_model_len)
        self.runner = ModelRunner(config, self.model_config, self.max_model_len)
        drafts = config.speculative.num_speculative_tokens if config.speculative is not None else 0
        self.blocks = KVCacheGroups(self.runner.num_blocks, config.kv_block_size, self.runner.kv_layout.group_windows,
                                    enable_prefix_caching=config.enable_kv_cache_reuse,
                                    max_prefill_tokens=config.max_num_batched_tokens, max_decode_tokens=1 + drafts)
        self.scheduler = make_scheduler(config, self.blocks, self.max_model_len)
        # speculative decoding (backend/spec/): None when speculative_config is empty
        self.speculator = Speculator.create(config, self.scheduler, self.vocab_size, self.max_model_len,
                                            self.runner.num_blocks * config.kv_block_size)
        self.outputs = OutputProcessor(self.tokenizer)
        self.loras = EngineLoRAs(self.runner.lora, self.scheduler)  # adapters by name (docs/lora.md)
        self.queue = QueueReporter(self.scheduler)  # where requests that asked stand
        self.kv_events = attach_publisher(config.kv_events, self.blocks, self.runner.device, self.loras.name_of_salt)
        self.grammars = ConstraintCompiler(self.tokenizer, self.vocab_size, self._eos_token_ids(),
                                           timeout=config.structured_outputs_compile_timeout_s)
        self.waitlist = GrammarWaitlist()  # requests whose constraint compiles (off the request path)
        self.kv_tiers = attach_kv_tiers(config, self.blocks, self.runner, self.scheduler.admission)  # backend/kv_tiers/
        self._seeds = random.Random(config.seed)  # seeds for requests that gave none
        self.idle = True  # the last step ran nothing (a batching gate is holding requests back)
        self.prompt_tokens_total = self.generation_tokens_total = 0

    def _max_model_len(self) -> int:
        limit = self.model_config.max_position_embeddings  # (sliding windows: the attention's, per layer)
        if self.config.max_model_len == 0:
            return limit
        if self.config.max_model_len > limit:
            raise ValueError(f"max_model_len ({self.config.max_model_len}) exceeds what the model "
                             f"supports ({limit})")
        return self.config.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    # -- requests -------------------------------------------------------------------------------
    def make_request(self, request_id: str, prompt: Prompt, params: SamplingParams,
                     arrival_time: Optional[float] = None, priority: int = 0, queue_info: bool = False,
                     lora_request: LoRALike = None) -> Request:
        """Tokenize and check a request against every limit; raises ValueError saying which.
        `queue_info`: its outputs carry a QueueInfo, and while it waits it gets outputs of its own
        whenever its place or reservation changes (queue_report.py). `lora_request`: its LoRA
        adapter, a name or a LoRARequest (docs/lora.md)."""
        params.validate()
        params.check_token_ids(self.vocab_size)
        priority = int32(priority, "priority")
        lora = self.loras.resolve(lora_request)
        ids = self._prompt_ids(prompt)
        self.scheduler.check_fits(len(ids), params.max_tokens, params.n)
        request = Request(request_id, ids, params, self._eos_token_ids(), arrival_time,
                          seed=self._seeds.getrandbits(63), priority=priority)
        request.bad_words_ids = self._bad_words_ids(params.bad_words)
        if params.structured_outputs is not None:  # cached: attached now; new: compiles while it waits
            self.grammars.attach(request)
        request.reports_queue = queue_info
        if lora is not None:
            request.lora_name, request.cache_salt = lora.name, lora.salt
        return request

    def _eos_token_ids(self) -> tuple[int, ...]:
        eos = self.model_config.eos_token_ids
        if not eos and self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos = (self.tokenizer.eos_token_id,)
        return tuple(eos)

    def _prompt_ids(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            check_text(prompt, "prompt")  # a lone surrogate: no text the tokenizer can take
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
        return ids

    def _bad_words_ids(self, words: list[str]) -> list[list[int]]:
        """Each bad word's tokens, alone and after a space (as vLLM: a word is banned both at the
        start of the text and inside it)."""
        if not words:
            return []
        if self.tokenizer is None:
            raise ValueError("bad_words needs a tokenizer: this checkpoint has no tokenizer.json")
        out = []
        for word in words:
            plain = self.tokenizer.encode(word.lstrip(), add_special_tokens=False)
            spaced = self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            out.append(plain)
            if spaced and spaced != plain and len(spaced) == len(plain):
                out.append(spaced)
        return [w for w in out if w]

    def check_queue(self, pending: int = 0) -> None:
        limit = self.config.max_queue_size
        if limit and len(self.scheduler.waiting) + len(self.waitlist) + pending >= limit:
            raise QueueFullError(f"queue full: {limit} requests are waiting (max_queue_size); retry later")

    def add(self, request: Request) -> None:
        """Queue a made request and, when it asks for n > 1, its n - 1 sibling completions (the
        scheduler checks each as it queues it; all share the prompt and params, so the first
        refusal comes before any is queued). A request whose constraint compiles waits in the
        waitlist instead, and is queued by the step that finds its grammar ready."""
        if request.pending_grammar is not None:
            self.waitlist.add(request, request.pending_grammar)
            return
        family = [request] + [Request(request.request_id, request.prompt_token_ids, request.params,
                                      request.eos_token_ids, request.arrival_time, seed=self._seeds.getrandbits(63),
                                      priority=request.priority, index=i) for i in range(1, request.params.n)]
        for seq in family:
            seq.bad_words_ids = request.bad_words_ids
            seq.lora_name, seq.cache_salt = request.lora_name, request.cache_salt
            if seq is not request and request.grammar is not None:
                seq.grammar = request.grammar.sibling()  # each completion follows the grammar on its own
            self.scheduler.add(seq)
            self.outputs.add(seq)
            self.queue.follow(seq)
        self.prompt_tokens_total += request.num_prompt_tokens

    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams, priority: int = 0,
                    queue_info: bool = False, lora_request: LoRALike = None) -> Request:
        self.check_queue()
        request = self.make_request(request_id, prompt, params, priority=priority, queue_info=queue_info,
                                    lora_request=lora_request)
        self.add(request)
        return request

    def abort(self, request_id: str) -> list[RequestOutput]:
        """Abort every completion of the request; their final outputs (none if it is unknown)."""
        compiling = self.waitlist.remove(request_id)
        if compiling is not None:
            return self._deliver([self._end(compiling, RequestStatus.FINISHED_ABORTED)])
        return self._deliver([self.outputs.ended(r) for r in self.scheduler.abort(request_id)])

    def has_work(self) -> bool:  # anything unfinished, compiling constraints included
        return self.scheduler.has_work or len(self.waitlist) > 0

    def has_runnable_work(self) -> bool:
        """Something a step can do now: a request to schedule, or a compile that has ended."""
        return self.scheduler.has_work or self.waitlist.has_ready()

    def _admit_compiled(self) -> list[RequestOutput]:
        """Queue the requests whose grammar is ready; end those whose constraint was refused."""
        ready, refused = self.waitlist.take_compiled(self.grammars)
        for request in ready:
            self.add(request)
        return [self._end(request, RequestStatus.FINISHED_ERROR) for request in refused]

    def _end(self, request: Request, status: RequestStatus) -> RequestOutput:  # one that never reached the scheduler
        request.status, request.finished_time = status, time.monotonic()
        return self.outputs.closing(request)

    # -- one step -------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        refused = self._admit_compiled() if len(self.waitlist) else []
        batch = self.scheduler.schedule(time.monotonic())
        self.kv_tiers.move(idle=batch.is_empty)  # the KV tiers' copies schedule() decided, before the model run
        self.idle = batch.is_empty
        if batch.is_empty:
            return self._deliver(refused)
        if self.speculator is not None:  # decode rows may become verify rows: drafts from the spare budget
            self.speculator.propose(batch)
        try:
            sampled = self.runner.run(batch)
        except Exception as exc:  # a failed step fails its own requests, not the engine
            log.exception("model step failed")
            return self._fail([s.request for s in batch.seqs], f"model step failed: {exc!r}", refused)
        self.scheduler.postprocess(batch, sampled, time.monotonic())
        outputs, stopped = self.outputs.step_outputs([s.request for s in batch.seqs], sampled)
        outputs = refused + outputs
        self.generation_tokens_total += sum(len(o.new_token_ids) for o in outputs)
        for req in stopped:
            self.scheduler.finish(req, RequestStatus.FINISHED_STOPPED)
        if self.speculator is not None:
            self.speculator.after_step(batch, sampled)
        return self._deliver(outputs)

    def _deliver(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """What to hand out: the step's outputs with where followed requests stand, held back
        while a padded batch runs. Every way out of the engine passes here: the draft model's state
        of the requests that ended (stopped, aborted, failed) is dropped here too."""
        if self.speculator is not None:
            self.speculator.release_finished()
        self.kv_events.end_step()  # the step's changes to the prefix cache, as one batch of KV-cache events
        return self.scheduler.deliver(self.queue.report(outputs))

    def _fail(self, requests: list[Request], message: str, earlier: list[RequestOutput] = ()) -> list[RequestOutput]:
        for req in requests:
            if not req.status.finished:
                req.error = message
                self.scheduler.finish(req, RequestStatus.FINISHED_ERROR)
        return self._deliver(list(earlier) + [self.outputs.ended(req) for req in requests])

    def fail_running(self, message: str) -> list[RequestOutput]:
        """After an unexpected exception in a step outside the model run (in scheduling or
        postprocessing): fail the requests of the batch (those holding blocks), keep the waiting
        ones, and check that the block and queue state is still sound (raises if it is not)."""
        results = []
        for req in self.scheduler.holders():
            req.error = message
            self.scheduler.finish(req, RequestStatus.FINISHED_ERROR)
            results.append(self.outputs.closing(req))
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
            "generation_tokens_total": self.generation_tokens_total,
            "lora_requests": self.loras.requests(),  # adapter -> {"running": n, "waiting": n}
            **(self.speculator.stats() if self.speculator else {}), **self.runner.moe_stats(), **self.kv_tiers.figures(),
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
