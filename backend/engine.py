"""The engine: one step is schedule -> run -> postprocess -> outputs.

`LLMEngine` is single-threaded and synchronous (the offline `LLM` drives it directly).
`AsyncEngine` (async_engine.py) runs it on its own thread for the server. Who runs is the
scheduler's (backend/sched/); the model run is the runner's (runner.py, the only device-facing
layer); text, stop strings and logprobs are the output processor's, which returns the requests a
stop string ended for the scheduler to finish.
"""
from __future__ import annotations

import logging
import random
import time
from typing import Optional, Union

from backend.block_manager import BlockManager
from backend.config import EngineConfig
from backend.errors import QueueFullError
from backend.kv_event_publisher import attach_publisher
from backend.kv_tiers.attach import attach_kv_tiers, persist_kv_tiers
from backend.loader import load_model_config
from backend.lora.engine_api import EngineLoRAs
from backend.lora.sources import LoRALike
from backend.output_processor import OutputProcessor
from backend.queue_report import QueueReporter
from backend.outputs import RequestOutput
from backend.request import Request, RequestStatus, SamplingParams
from backend.runner import ModelRunner
from backend.sched.factory import make_scheduler
from backend.spec.speculator import Speculator
from backend.structured.compiler import ConstraintCompiler
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
        self.max_input_bytes = config.max_input_bytes or self._derived_max_input_bytes()
        self.runner = ModelRunner(config, self.model_config, self.max_model_len)
        self.blocks = BlockManager(self.runner.num_blocks, config.kv_block_size,
                                   enable_prefix_caching=config.enable_kv_cache_reuse)
        self.scheduler = make_scheduler(config, self.blocks, self.max_model_len)
        # speculative decoding (backend/spec/): None when speculative_config is empty
        self.speculator = Speculator.create(config, self.scheduler, self.vocab_size, self.max_model_len,
                                            self.runner.num_blocks * config.kv_block_size)
        self.outputs = OutputProcessor(self.tokenizer)
        self.loras = EngineLoRAs(self.runner.lora, self.scheduler)  # adapters by name (docs/lora.md)
        self.queue = QueueReporter(self.scheduler)  # where requests that asked stand
        # KV-cache events for a router (kv_events_config): None when off
        self.kv_events = attach_publisher(config.kv_events, self.blocks, self.runner.device, self.loras.name_of_salt)
        # KV tiers (backend/kv_tiers/): None when kv_host_cache_bytes is 0
        self.kv_tiers = self.scheduler.admission.tiers = attach_kv_tiers(config, self.blocks, self.runner)
        self.grammars = ConstraintCompiler(self.tokenizer, self.vocab_size, self._eos_token_ids())  # structured outputs
        self._seeds = random.Random(config.seed)  # seeds for requests that gave none
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
                     arrival_time: Optional[float] = None, priority: int = 0, queue_info: bool = False,
                     lora_request: LoRALike = None) -> Request:
        """Tokenize and check a request against every limit; raises ValueError saying which.
        `queue_info`: its outputs carry a QueueInfo, and while it waits it gets outputs of its own
        whenever its place or reservation changes (queue_report.py). `lora_request`: its LoRA
        adapter, a name or a LoRARequest (docs/lora.md)."""
        params.validate()
        lora = self.loras.resolve(lora_request)
        ids = self._prompt_ids(prompt)
        self.scheduler.check_fits(len(ids), params.max_tokens, params.n)
        request = Request(request_id, ids, params, self._eos_token_ids(), arrival_time,
                          seed=self._seeds.getrandbits(63), priority=priority)
        request.bad_words_ids = self._bad_words_ids(params.bad_words)
        request.grammar = self.grammars.new_state(params)  # compiled (or cached) now, before any KV block
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
        if limit and len(self.scheduler.waiting) + pending >= limit:
            raise QueueFullError(f"queue full: {limit} requests are waiting (max_queue_size); retry later")

    def add(self, request: Request) -> None:
        """Queue a made request and, when it asks for n > 1, its n - 1 sibling completions (the
        scheduler checks each as it queues it; all share the prompt and params, so the first
        refusal comes before any is queued)."""
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
        return self._deliver([self.outputs.ended(r) for r in self.scheduler.abort(request_id)])

    def has_work(self) -> bool:
        return self.scheduler.has_work

    # -- one step -------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        tiers = self.kv_tiers
        if tiers is not None:  # copies and disk reads that landed: requests whose prefix is back may run
            tiers.poll(self.runner.kv_copy_done)
        batch = self.scheduler.schedule(time.monotonic())
        if tiers is not None:  # the saves and loads schedule() decided, ordered before the model run
            tiers.move(self.runner)
        self.idle = batch.is_empty
        if batch.is_empty:
            if tiers is not None:
                tiers.wait_for_disk(0.005)  # only prefixes on their way back from disk: nothing to run
            return self._deliver([])
        if self.speculator is not None:  # decode rows may become verify rows: drafts from the spare budget
            self.speculator.propose(batch)
        try:
            sampled = self.runner.run(batch)
        except Exception as exc:  # a failed step fails its own requests, not the engine
            log.exception("model step failed")
            return self._fail([s.request for s in batch.seqs], f"model step failed: {exc!r}")
        self.scheduler.postprocess(batch, sampled, time.monotonic())
        outputs, stopped = self.outputs.step_outputs([s.request for s in batch.seqs], sampled)
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
        if self.kv_events is not None:  # the step's changes to the prefix cache, as one batch
            self.kv_events.collector.end_step()
        return self.scheduler.deliver(self.queue.report(outputs))

    def _fail(self, requests: list[Request], message: str) -> list[RequestOutput]:
        for req in requests:
            if not req.status.finished:
                req.error = message
                self.scheduler.finish(req, RequestStatus.FINISHED_ERROR)
        return self._deliver([self.outputs.ended(req) for req in requests])

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
            "num_requests_waiting": len(self.scheduler.waiting),
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
            **(self.speculator.stats() if self.speculator is not None else {}),
            **({"kv_tiers": self.kv_tiers.stats()} if self.kv_tiers is not None else {}),
        }

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()
        if self.speculator is not None:
            self.speculator.check_integrity()
        if self.kv_tiers is not None:
            self.kv_tiers.check_integrity()

    def close(self) -> None:
        """Release what outlives the object: the other tensor-parallel ranks' processes, the KV-event
        publisher's thread and sockets, the KV tiers' disk thread (after the device's cached blocks
        are written down, so that a restarted engine finds them)."""
        if self.kv_events is not None:
            self.kv_events.close()
        if self.kv_tiers is not None:
            try:
                persist_kv_tiers(self.kv_tiers, self.runner)
            finally:
                self.kv_tiers.close()
                self.kv_tiers = None
        self.runner.close()
