"""`LLMEngine`: requests in, outputs out. The engine core (core.py: schedule -> run -> update on the
engine thread) with its front: tokenizing and checking each request before it is queued, and the
delivery side's text (output_processor.py).

`LLMEngine.step()` is the offline API's: one core step, then its outputs made text on the caller's
thread, and a sequence a stop string ended finished at once. The server's `AsyncEngine`
(async_engine.py) runs the core's steps on the engine thread and the text on its output thread.
"""
from __future__ import annotations

import logging
import random
from typing import Optional, Union

from backend.core.config import EngineConfig
from backend.core.errors import QueueFullError, TTFTTargetError
from backend.core.input_guard import check_text, int32
from backend.core.lora import LoRALike
from backend.core.outputs import CoreOutput, RequestOutput
from backend.core.sampling_params import SamplingParams
from backend.core.request import Request
from backend.engine.core import EngineCore
from backend.engine.images import ImageFront, split_prompt
from backend.engine.output_processor import OutputProcessor
from backend.engine.wiring import build_core
from backend.sched.beams import refuse_beams
from backend.engine.pooling import engine_pooling, make_pooling_request, refuse_generation, with_classifier_tokens
from backend.core.pooling import PoolingParams
from backend.models.loader import load_model_config
from backend.text.tokenizer import Tokenizer, max_input_bytes

log = logging.getLogger(__name__)
Prompt = Union[str, list[int]]
REJECT_REASONS = ("queue_full", "ttft_target")  # the rejection counter's reasons (templates/metrics.py)


class LLMEngine(EngineCore):
    def __init__(self, config: EngineConfig):
        if not config.model_path:
            raise ValueError("model_path is required (a Hugging Face checkpoint directory)")
        self.model_config = load_model_config(config.model_path)
        self.max_model_len = self._max_model_len(config)
        self.tokenizer = Tokenizer.from_dir(config.model_path)
        self.model_config = with_classifier_tokens(self.model_config, self.tokenizer)  # (a reranker's score head)
        self.max_input_bytes = config.max_input_bytes or max_input_bytes(self.tokenizer, self.max_model_len)
        build_core(self, config, self.model_config, self.max_model_len, self.tokenizer, self._eos_token_ids())
        self.outputs = OutputProcessor(self.tokenizer)
        self.images = ImageFront(config.model_path, config, self.tokenizer)  # a vision model's images
        self._seeds = random.Random(config.seed)  # seeds for requests that gave none
        self.pooling = self.outputs.pooling = engine_pooling(config, self.model_config)  # None: it generates
        self.rejected: dict[str, int] = {}  # refused at arrival (check_queue), by reason

    def _max_model_len(self, config: EngineConfig) -> int:
        limit = self.model_config.max_position_embeddings  # (sliding windows: the attention's, per layer)
        if config.max_model_len == 0:
            return limit
        if config.max_model_len > limit:
            raise ValueError(f"max_model_len ({config.max_model_len}) exceeds what the model supports ({limit})")
        return config.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    # -- requests -------------------------------------------------------------------------------
    def make_request(self, request_id: str, prompt: Prompt, params: SamplingParams,
                     arrival_time: Optional[float] = None, priority: int = 0, queue_info: bool = False,
                     lora_request: LoRALike = None, pooling: Optional[PoolingParams] = None) -> Request:
        """Tokenize and check a request against every limit; raises ValueError saying which.
        `queue_info`: its outputs carry a QueueInfo, and while it waits it gets outputs of its own
        whenever its place or reservation changes (queue_report.py). `lora_request`: its LoRA
        adapter, a name or a LoRARequest (docs/lora.md). `pooling`: a pooling request instead (docs/pooling.md),
        of which `params` gives only truncate_prompt_tokens."""
        if pooling is not None:
            return make_pooling_request(self, request_id, prompt, pooling, params.truncate_prompt_tokens, priority)
        params.validate()
        params.check_token_ids(self.vocab_size)
        refuse_generation(self.pooling, self.model_config.head)
        priority = int32(priority, "priority")
        lora = self.loras.resolve(lora_request)
        prompt, images = split_prompt(prompt)  # vLLM's {"prompt": ..., "multi_modal_data": {"image": [...]}}
        if images:  # (docs/vision.md) checked and laid out here, preprocessed on this thread
            self.images.check(images, params.truncate_prompt_tokens)
        ids = self._prompt_ids(prompt, params.truncate_prompt_tokens)
        items = []
        if images:  # placeholders expanded (Qwen2.5-VL: to each image's own size), images preprocessed
            ids, items = self.images.lay_out(ids, images)
            if len(ids) > self.max_model_len:
                raise ValueError(f"prompt has {len(ids)} tokens with its images; max_model_len is {self.max_model_len}")
        self.scheduler.check_fits(len(ids), params.max_tokens, max(params.n, params.beam_width))
        refuse_beams(params, self.config, self.blocks, len(ids))
        request = Request(request_id, ids, params, self._eos_token_ids(), arrival_time,
                          seed=self._seeds.getrandbits(63), priority=priority)
        request.bad_words_ids = self._bad_words_ids(params.bad_words)
        request.mm_items = items
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

    def _prompt_ids(self, prompt: Prompt, truncate: Optional[int] = None) -> list[int]:
        """The prompt's token ids, checked; `truncate` (truncate_prompt_tokens): its last k tokens
        only, -1 its last max_model_len (vLLM's left truncation)."""
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
            if truncate is None and len(prompt) > self.max_model_len:
                raise ValueError(f"prompt has {len(prompt)} tokens; max_model_len is {self.max_model_len}")
            ids = [int(t) for t in prompt]
            bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise ValueError(f"input_ids: token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        if truncate is not None:
            ids = ids[-(self.max_model_len if truncate == -1 else truncate):]
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

    def check_queue(self, pending: int = 0, request: Optional[Request] = None) -> None:
        """Refuse at arrival a request the queue has no room for (max_queue_size), or, given the
        made `request`, one the queue cannot start within its time-to-first-token target
        (ttft_target_ms): a QueueFullError whose message ends "retry after N s", N from the
        queue's expected drain time (backend/sched/drain.py, read as of the last step)."""
        limit = self.config.max_queue_size
        if limit and len(self.scheduler.waiting) + len(self.waitlist) + pending >= limit:
            self._refuse(QueueFullError(f"queue full: {limit} requests are waiting (max_queue_size); the queue's "
                                        f"expected drain time is {self.drain.drain_seconds():.1f} s",
                                        self.drain.drain_seconds()))
        target_ms = None if request is None else request.params.ttft_target_ms
        target_ms = self.config.ttft_target_ms if target_ms is None else target_ms
        if request is not None and target_ms:
            expected = self.drain.expected_ttft(request.num_prompt_tokens, request.params.max_tokens)
            if expected * 1000.0 > target_ms:
                self._refuse(TTFTTargetError(
                    f"the queue cannot meet the time-to-first-token target: expected {expected:.2f} s, target "
                    f"{target_ms / 1000.0:.3g} s (ttft_target_ms)", expected - target_ms / 1000.0))

    def _refuse(self, error: QueueFullError) -> None:
        self.rejected[error.reason] = self.rejected.get(error.reason, 0) + 1
        raise error

    def rejections(self) -> dict[str, int]:
        """Requests refused at arrival so far, by reason (stats keys num_rejected_<reason>)."""
        return {f"num_rejected_{reason}": self.rejected.get(reason, 0) for reason in REJECT_REASONS}

    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams, priority: int = 0,
                    queue_info: bool = False, lora_request: LoRALike = None) -> Request:
        request = self.make_request(request_id, prompt, params, priority=priority, queue_info=queue_info,
                                    lora_request=lora_request)
        self.check_queue(request=request)
        self.outputs.add(request)
        self.add(request)
        return request

    def add_pooling_request(self, request_id: str, prompt: Prompt, params: Optional[PoolingParams] = None,
                            truncate_prompt_tokens: Optional[int] = None, priority: int = 0) -> Request:
        """A pooling request (runner pooling, docs/pooling.md): its output's `pooled` is its embedding or scores."""
        request = make_pooling_request(self, request_id, prompt, params, truncate_prompt_tokens, priority)
        self.check_queue(request=request)
        self.outputs.add(request)
        self.add(request)
        return request

    # -- steps, with their text -----------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One core step, its outputs made text here; a sequence a stop string ended is finished
        in the scheduler before this returns."""
        return self.deliver(self.core_step())

    def abort(self, request_id: str) -> list[RequestOutput]:
        """Abort every completion of the request; their final outputs (none if it is unknown)."""
        return self.deliver(self.core_abort(request_id))

    def deliver(self, outputs: list[CoreOutput]) -> list[RequestOutput]:
        """The core's outputs as the callers see them (the delivery side, on this thread)."""
        results, stopped = self.outputs.process(outputs)
        if stopped:
            self.outputs.process(self.stop(stopped))  # the engine's final outputs of them: nothing new
        return results

    def stats(self) -> dict[str, Union[int, float]]:
        return {**super().stats(), "generation_tokens_total": self.outputs.generation_tokens_total, **self.rejections(),
                "pooling_requests_total": self.outputs.pooling_requests_total,
                "pooling_prompt_tokens_total": self.outputs.pooling_tokens_total}
