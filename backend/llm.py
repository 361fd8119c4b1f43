"""The offline API: `LLM(model_path, **overrides).generate(prompts, params)`."""
from __future__ import annotations

import itertools
from typing import Optional, Sequence, Union

from backend.config import EngineConfig
from backend.engine import LLMEngine, Prompt
from backend.outputs import RequestOutput
from backend.request import SamplingParams


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
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Run every prompt to completion, batched in flight; results come back in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        order = []
        for prompt, p in zip(prompts, params):
            request = self.engine.add_request(f"offline-{next(self._ids)}", prompt, p)
            order.append(request.request_id)
        results: dict[str, RequestOutput] = {}
        bar = _progress(len(order)) if use_tqdm else None
        while self.engine.has_work():
            for output in self.engine.step():
                if output.finished:
                    results[output.request_id] = output
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return [results[rid] for rid in order]

    def stats(self) -> dict:
        return self.engine.stats()

    def check_integrity(self) -> None:
        self.engine.check_integrity()


def _progress(total: int):
    from tqdm import tqdm
    return tqdm(total=total, desc="generate", unit="req")
