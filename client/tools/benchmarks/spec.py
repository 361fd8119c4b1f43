"""`inflight bench --speculative-config JSON`: one engine with and one without speculative
decoding, on the same workload, turn and turn about (plain, spec, then spec, plain, ...), one
engine alive at a time, in this process:

    inflight bench --in-process --model-path models/smollm2-135m-instruct --workload extractive \\
        --num-requests 8 --concurrency 1,4,16 --repeats 2 \\
        --speculative-config '{"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_min": 2,
                               "prompt_lookup_max": 4, "disable_by_batch_size": 8}'

Reported per run, beside the usual figures: the drafts verified and accepted (acceptance rate,
mean tokens per verify step); and per concurrency the ratios spec/plain of output tokens/s and of
TTFT p50, on the means of the repeats and repeat by repeat.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from client.tools.benchmarks.targets import InProcessTarget

PLAIN, SPEC = "in-process", "in-process+spec"


class SpecTarget(InProcessTarget):
    """The in-process engine with `speculative_config`; its runs also report what was drafted."""
    name = SPEC

    def __init__(self, model_path: str, mode: str, params: dict[str, str], speculative_config: str):
        super().__init__(model_path, mode, {**params, "speculative_config": speculative_config})

    def run(self, items, concurrency: int, progress: bool = False, timeout: float = 3600.0) -> dict[str, Any]:
        before = self.engine.stats()
        result = super().run(items, concurrency, progress, timeout)
        after = self.engine.stats()
        drafts = after["spec_decode_num_draft_tokens"] - before["spec_decode_num_draft_tokens"]
        accepted = after["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
        steps = sum(after["spec_decode_acceptance_lengths"]) - sum(before["spec_decode_acceptance_lengths"])
        return {**result, "spec_draft_tokens": drafts, "spec_accepted_tokens": accepted,
                "spec_acceptance_rate": accepted / drafts if drafts else None,
                "spec_mean_acceptance_length": (accepted + steps) / steps if steps else None}


def compare(model_path: str, params: dict[str, str], speculative_config: str, concurrencies: Sequence[int],
            repeats: int, measure: Callable[[Any, list[int]], None]) -> None:
    """Measure both engines at each concurrency, alternating their order by repeat; each turn
    builds its engine before the clock starts and closes it after (idle engines on other threads
    slow the running one down on a small machine)."""
    for c in concurrencies:
        for i in range(repeats):
            for spec in ((False, True) if i % 2 == 0 else (True, False)):
                target = (SpecTarget(model_path, "inflight", params, speculative_config) if spec
                          else InProcessTarget(model_path, "inflight", params))
                try:
                    measure(target, [c])
                finally:
                    target.close()


def spec_ratios(results: Sequence[dict]) -> list[dict]:
    """spec/plain per concurrency: output tokens/s and TTFT p50 (means of the repeats, and repeat
    by repeat)."""
    out = []
    for c in sorted({r["concurrency"] for r in results if r["target"] == SPEC}):
        runs = {t: [r for r in results if r["target"] == t and r["concurrency"] == c] for t in (PLAIN, SPEC)}
        for key, kind in (("output_tokens_per_s", "spec/plain out tok/s"), ("ttft_p50_s", "spec/plain TTFT p50")):
            a = [r[key] for r in runs[SPEC] if r.get(key)]
            b = [r[key] for r in runs[PLAIN] if r.get(key)]
            if a and b:
                out.append({"kind": kind, "target": SPEC, "concurrency": c, "ratio": float(np.mean(a) / np.mean(b)),
                            "per_repeat": [x / y for x, y in zip(a, b)] if len(a) == len(b) > 1 else []})
    return out


def print_acceptance(results: Sequence[dict]) -> None:
    for r in results:
        if r["target"] == SPEC and r.get("spec_draft_tokens"):
            print(f"c={r['concurrency']:<4} drafts {r['spec_draft_tokens']}, accepted {r['spec_accepted_tokens']} "
                  f"({100 * r['spec_acceptance_rate']:.0f}%), {r['spec_mean_acceptance_length']:.2f} tokens "
                  f"per verify step")
