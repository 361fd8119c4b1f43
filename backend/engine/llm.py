"""The offline API: `LLM(model_path, **overrides).generate(prompts, params)`."""
from __future__ import annotations

import dataclasses
import itertools
from typing import Optional, Sequence, Union

from backend.core.config import EngineConfig
from backend.engine.llm_engine import LLMEngine, Prompt
from backend.core.outputs import RequestOutput
from backend.core.lora import LoRALike
from backend.core.pooling import PoolingParams
from backend.core.sampling_params import SamplingParams

SETTLE_SECONDS = 10.0  # at most this long for the KV tiers' jobs in flight when generate() has its outputs


class LLM:
    def __init__(self, model_path: str, **overrides):
        self.config = EngineConfig(model_path=str(model_path), **overrides)
        self.engine = LLMEngine(self.config)
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Union[Prompt, Sequence[Prompt]],
                 params: Optional[Union[SamplingParams, Sequence[SamplingParams]]] = None,
                 use_tqdm: bool = False, priority: Union[int, Sequence[int]] = 0,
                 lora_request: Union[LoRALike, Sequence[LoRALike]] = None) -> list[RequestOutput]:
        """Run every prompt to completion, batched in flight; results come back in prompt order.
        With n > 1, each result is the first completion and `samples` holds all n (by index).
        `priority`: one for all or one per prompt; lower runs first. `lora_request`: the LoRA
        adapter (a LoRARequest, as vLLM's, or a loaded adapter's name; None: the base model), one
        for all or one per prompt; requests of different adapters run in the same steps."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        priorities = [priority] * len(prompts) if isinstance(priority, int) else list(priority)
        loras = list(lora_request) if isinstance(lora_request, (list, tuple)) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"got {len(loras)} lora_requests for {len(prompts)} prompts")
        order = []
        for prompt, p, prio, lora in zip(prompts, params, priorities, loras):
            request = self.engine.add_request(f"offline-{next(self._ids)}", prompt, p, priority=prio,
                                              lora_request=lora)
            order.append(request.request_id)
        done: dict[str, list[RequestOutput]] = {rid: [] for rid in order}
        bar = _progress(len(order)) if use_tqdm else None
        while self.engine.has_work():
            if not self.engine.has_runnable_work():  # only constraints compiling: wait for one
                self.engine.waitlist.wait(0.05)
            for output in self.engine.step():
                if output.finished:
                    done[output.request_id].append(output)
                    if bar is not None and len(done[output.request_id]) == 1:
                        bar.update(1)
        if bar is not None:
            bar.close()
        self.engine.settle_tiers(SETTLE_SECONDS)  # the KV tiers' last disk writes retire before we return
        results = []
        for rid in order:
            samples = sorted(done[rid], key=lambda o: o.index)
            first = samples[0]
            if len(samples) > 1:
                first = dataclasses.replace(first, samples=samples)
            results.append(first)
        return results

    # -- pooling (runner pooling, docs/pooling.md) -------------------------------------------------
    def embed(self, prompts: Union[Prompt, Sequence[Prompt]], params: Optional[PoolingParams] = None,
              truncate_prompt_tokens: Optional[int] = None) -> list[RequestOutput]:
        """Pool every prompt (in flight, in prompt order): each output's `pooled` is its embedding, or
        for a classifier (a cross-encoder) its scores (vLLM's LLM.embed / LLM.classify)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        order = [self.engine.add_pooling_request(f"offline-{next(self._ids)}", p, params, truncate_prompt_tokens
                                                 ).request_id for p in prompts]
        done: dict[str, RequestOutput] = {}
        while self.engine.has_work():
            done.update((o.request_id, o) for o in self.engine.step() if o.finished)
        return [done[rid] for rid in order]

    classify = embed

    # -- LoRA adapters at run time (docs/lora.md) ----------------------------------------------------
    def load_lora(self, name: str, path: str) -> None:
        """Load a PEFT adapter folder under `name` (needs enable_lora); requests then name it."""
        self.engine.loras.load(name, str(path))

    def unload_lora(self, name: str) -> None:
        """Unload an adapter that no request uses: one that a request added to the engine holds
        (running, queued, or waiting for its constraint to compile) is refused with a ValueError
        naming it and them, and stays loaded. (The serving engine's unload drains instead:
        AsyncEngine.unload_lora.)"""
        self.engine.loras.unload(name, self.engine.waitlist)

    def list_loras(self) -> list[str]:
        return self.engine.loras.names()

    def stats(self) -> dict:
        return self.engine.stats()

    def check_integrity(self) -> None:
        self.engine.check_integrity()

    def close(self) -> None:
        """Stop the engine's other tensor-parallel ranks (with one rank there is nothing to stop)."""
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _progress(total: int):
    from tqdm import tqdm
    return tqdm(total=total, desc="generate", unit="req")
