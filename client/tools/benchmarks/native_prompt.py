"""Steps with prompt rows through the C layer stack against the Python layers, in one process (issue 47).

    python -m client.tools.benchmarks.native_prompt --model-path models/smollm2-135m-instruct-q4_1 \\
        [--prompt 3000] [--decodes 6] [--chunks 128,256] [--rounds 2]

Two figures, each timed A B C C B A per round on the same engine: the C stack (A), the Python
layers (B: `runner.decode_path.native` set to None between runs, what INFLIGHT_NATIVE_DECODE=0 does
at start) and the Python layers with torch's SDPA for the prompt rows' attention (C: the engine
before issue 47), so load drifts on a shared machine hit all alike:
- `ttft_s`: a prompt of --prompt random ids alone, one output token (its chunks of the default
  max_num_batched_tokens), wall time of LLM.generate;
- `mixed_ms`: the model time of a step of --decodes decode rows and one chunk of C prompt tokens
  (the runner's _compute: the layers and the LM head of the sampled rows), median over the long
  prompt's chunks while the streams decode (max_num_batched_tokens = decodes + C, no pacing).
Each figure is taken as wall time and as the process's CPU time (`*_cpu`: with OMP_NUM_THREADS=1
the work done, which a loaded machine's waits do not inflate). Prints one JSON line per figure:
each run's value and the ratios of the medians to the C stack's.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Callable, Optional, Sequence

import numpy as np


ARMS = ("c_stack", "python_layers", "python_layers_sdpa")


def _abc(llm, once: Callable[[], tuple], rounds: int, **fields) -> dict:
    """A B C C B A per round; each run returns (wall, cpu)."""
    from dataclasses import replace

    from kernels import reference
    runner = llm.engine.runner
    path, stack, metadata, ops = runner.decode_path, runner.decode_path.native, runner.metadata, runner.metadata.ops
    sdpa = replace(ops, prefill_attention=reference.prefill_attention)
    runs = {arm: [] for arm in ARMS}
    for _ in range(rounds):
        for arm in ARMS + ARMS[::-1]:
            path.native = stack if arm == "c_stack" else None
            metadata.ops = sdpa if arm == "python_layers_sdpa" else ops
            try:
                runs[arm].append(once())
            finally:
                path.native, metadata.ops = stack, ops
    out = dict(fields)
    for i, kind in enumerate(("wall", "cpu")):
        medians = {arm: statistics.median(x[i] for x in runs[arm]) for arm in ARMS}
        for arm in ARMS:
            out[f"{arm}_{kind}"] = [round(x[i], 4) for x in runs[arm]]
            if arm != "c_stack":
                out[f"ratio_{arm}_over_c_{kind}"] = round(medians[arm] / medians["c_stack"], 3)
    return out


def _clocks() -> tuple:
    return time.perf_counter(), time.process_time()


def ttft(model_path: str, length: int, rounds: int, seed: int) -> dict:
    from backend import LLM, SamplingParams
    llm = LLM(model_path, max_model_len=length + 64, cpu_kv_cache_tokens=length + 256, enable_kv_cache_reuse=False)
    assert llm.engine.runner.decode_path.native is not None, "the C stack is off for this model"
    rng = np.random.default_rng(seed)
    vocab = llm.engine.runner.model.cfg.vocab_size
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)

    def once() -> tuple:
        prompt = rng.integers(3, vocab, length).tolist()
        t0, c0 = _clocks()
        llm.generate([prompt], params)
        t1, c1 = _clocks()
        return t1 - t0, c1 - c0
    once()  # warm-up
    return _abc(llm, once, rounds, figure="ttft_s", prompt=length)


def mixed(model_path: str, length: int, decodes: int, chunk: int, rounds: int, seed: int) -> dict:
    from backend import LLM, SamplingParams
    llm = LLM(model_path, max_model_len=length + 64, max_num_seqs=decodes + 1, max_num_batched_tokens=decodes + chunk,
              inter_token_target_ms=0, cpu_kv_cache_tokens=(decodes + 1) * (length + 128), enable_kv_cache_reuse=False)
    runner = llm.engine.runner
    assert runner.decode_path.native is not None, "the C stack is off for this model"
    rng = np.random.default_rng(seed)
    vocab = runner.model.cfg.vocab_size
    compute, times = runner._compute, []

    def timed(step, graph_size):
        t0, c0 = _clocks()
        out = compute(step, graph_size)
        t1, c1 = _clocks()
        if step.num_decode_rows == decodes and step.ids.shape[0] - decodes == chunk:
            times.append((t1 - t0, c1 - c0))
        return out
    runner._compute = timed
    steps = length // chunk + 4

    def once() -> tuple:
        times.clear()
        streams = [rng.integers(3, vocab, 17).tolist() for _ in range(decodes)]
        llm.generate(streams + [rng.integers(3, vocab, length).tolist()],
                     SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True))
        return tuple(1000 * statistics.median(t[i] for t in times) for i in (0, 1))
    once()
    return _abc(llm, once, rounds, figure="mixed_ms", decodes=decodes, chunk=chunk, steps_timed=len(times))


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-path", required=True)
    p.add_argument("--prompt", type=int, default=3000)
    p.add_argument("--decodes", type=int, default=6)
    p.add_argument("--chunks", default="128,256")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-ttft", action="store_true")
    a = p.parse_args(argv)
    print(json.dumps({"load_average": os.getloadavg(), "threads": os.environ.get("OMP_NUM_THREADS")}), flush=True)
    if not a.skip_ttft:
        print(json.dumps(ttft(a.model_path, a.prompt, a.rounds, a.seed)), flush=True)
    for chunk in (int(c) for c in a.chunks.split(",")):
        print(json.dumps(mixed(a.model_path, a.prompt, a.decodes, chunk, a.rounds, a.seed)), flush=True)
    print(json.dumps({"load_average": os.getloadavg()}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
