"""What structured outputs cost: a decode step with some rows constrained against none, the mask's
share of the step, and a schema's compile time cold and cached.

    python -m client.tools.benchmarks.structured --model-path models/smollm2-135m-instruct [--compile-only]

Decode: `--batch` requests decode together (all past their prefill, none finishing inside the
window); in one engine, `--constrained` of them follow a JSON schema (an array of at least 20
nested person objects: every step inside strings, numbers, enums and objects, never its end) and
the rest are free. Full engine steps (schedule, model, masks, sampling, postprocess) are timed in
rounds A B B A against the same batch with no constraint, in one process, so that a shared
machine's load hits both alike; the medians are compared. Inside the constrained steps the mask
(`apply_grammar_masks`: every constrained row's bitmask filled, then one batched apply) and the
matchers' advance are timed on their own.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Callable

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 16},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "pets": {"type": "array", "items": {"enum": ["cat", "dog", "fish"]}, "maxItems": 3},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                "required": ["city", "zip"]}},
    "required": ["name", "age", "pets", "address"]}
PEOPLE = {"type": "array", "items": PERSON, "minItems": 20}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m client.tools.benchmarks.structured", description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", required=True)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--constrained", type=int, default=16)
    p.add_argument("--steps", type=int, default=6, help="timed steps per round")
    p.add_argument("--rounds", type=int, default=4, help="rounds of A B B A")
    p.add_argument("--output-json", type=Path)
    p.add_argument("--compile-only", action="store_true", help="only the compile times (no decode steps)")
    return p


class _Timed:
    """Wraps a function and adds up the seconds spent in it."""

    def __init__(self, fn: Callable):
        self.fn, self.seconds, self.calls = fn, 0.0, 0

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - start
            self.calls += 1


def _engine(model_path: str, batch: int, constrained: int):
    from backend import LLM, SamplingParams

    # KV for the window only (each row stays far below max_tokens): max_utilization admits on what
    # the step needs, not on max_tokens, and the cache is too small to reach it
    llm = LLM(model_path, max_num_seqs=batch, max_model_len=512, cpu_kv_cache_tokens=batch * 160,
              batch_scheduler_policy="max_utilization")
    spec = {"json": PEOPLE}
    for i in range(batch):
        kw = {"structured_outputs": spec} if i < constrained else {}
        llm.engine.add_request(f"r{i}", f"Describe {i} people as JSON.", SamplingParams(
            max_tokens=400, temperature=1.0, seed=i, ignore_eos=True, **kw))
    for _ in range(4):  # prefill, then a few decode steps: every row decoding
        llm.engine.step()
    return llm


def run(args: argparse.Namespace) -> dict:
    import backend.worker.sampler as sampler
    from backend.sched.grammar import GrammarState

    free = _engine(args.model_path, args.batch, 0)
    mixed = _engine(args.model_path, args.batch, args.constrained)
    mask = _Timed(sampler.apply_grammar_masks)
    sampler.apply_grammar_masks = mask
    import xgrammar

    apply = _Timed(xgrammar.apply_token_bitmask_inplace)
    xgrammar.apply_token_bitmask_inplace = apply
    advance = _Timed(GrammarState.advance)
    GrammarState.advance = lambda state, request, token: advance(state, request, token)
    times: dict[str, list[float]] = {"free": [], "mixed": []}

    def steps(name: str, llm) -> None:
        for _ in range(args.steps):
            start = time.perf_counter()
            llm.engine.step()
            times[name].append(time.perf_counter() - start)

    for _ in range(args.rounds):
        for name in ("free", "mixed", "mixed", "free"):
            before = mask.seconds, advance.seconds, apply.seconds
            steps(name, free if name == "free" else mixed)
            if name == "free":  # its own (empty) mask calls are not the constrained batch's cost
                mask.seconds, advance.seconds, apply.seconds = before
    for llm in (free, mixed):
        stats = llm.engine.stats()
        assert stats["num_requests_running"] == args.batch and stats["num_preemptions"] == 0, stats
    n_mixed = len(times["mixed"])
    free_step, mixed_step = statistics.median(times["free"]), statistics.median(times["mixed"])
    result = {
        "batch": args.batch, "constrained": args.constrained, "steps_each": n_mixed,
        "step_ms_none_constrained": 1e3 * free_step, "step_ms_with_constrained": 1e3 * mixed_step,
        "step_ratio": mixed_step / free_step,
        "mask_ms_per_step": 1e3 * mask.seconds / n_mixed,
        "mask_share_of_step": mask.seconds / sum(times["mixed"]),
        "of_which_apply_ms_per_step": 1e3 * apply.seconds / n_mixed,
        "advance_ms_per_step": 1e3 * advance.seconds / n_mixed,
    }
    result.update(_compile_times(args.model_path))
    return result


def _compile_times(model_path: str) -> dict:
    """A schema never seen before, cold (a worker process compiles it and the result is loaded
    here: what a request waits for) and then again (cached); the same schemas compiled in this
    process by xgrammar alone, interleaved (what the worker's isolation costs); the one-off
    tokenizer info."""
    import xgrammar as xgr

    from backend.models.loader import load_model_config
    from backend.engine.structured.compile_worker import build_grammar
    from backend.engine.structured.compiler import ConstraintCompiler
    from backend.core.structured import StructuredOutputs
    from backend.text.tokenizer import Tokenizer

    cfg = load_model_config(model_path)
    fresh = ConstraintCompiler(Tokenizer.from_dir(model_path), cfg.vocab_size, cfg.eos_token_ids)
    start = time.perf_counter()
    fresh.tokenizer.json()
    info = time.perf_counter() - start
    fresh.warm_up().result(600)  # a worker up, with this tokenizer: not in the cold figures
    local = xgr.GrammarCompiler(fresh.tokenizer.info(), max_threads=2, cache_enabled=False)
    cold, cached, in_process = [], [], []
    for i in range(7):
        schema = dict(PERSON, properties={**PERSON["properties"], f"extra_{i}": {"type": "integer"}})
        spec = StructuredOutputs(json=schema)
        start = time.perf_counter()
        fresh.compile(spec, timeout=60)
        cold.append(time.perf_counter() - start)
        start = time.perf_counter()
        fresh.compile(spec)
        cached.append(time.perf_counter() - start)
        start = time.perf_counter()
        build_grammar(local, "json", spec.source, True)
        in_process.append(time.perf_counter() - start)
    return {"tokenizer_info_ms_once": 1e3 * info, "compile_ms_cold": 1e3 * statistics.median(cold),
            "compile_ms_in_process": 1e3 * statistics.median(in_process),
            "cold_over_in_process": statistics.median(cold) / statistics.median(in_process),
            "compile_ms_cached": 1e3 * statistics.median(cached)}


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    result = _compile_times(args.model_path) if args.compile_only else run(args)
    print(json.dumps(result, indent=2))
    if args.output_json:
        args.output_json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
