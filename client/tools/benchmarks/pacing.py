"""Decodes under arriving long prompts (issue 45's must-show): streams decode while long prompts
arrive, with prefill pacing on (the default) and off (`inter_token_target_ms=0`, the behaviour
before pacing), in turns A B B A in one process on the in-process threaded engine (AsyncEngine).

    python -m client.tools.benchmarks.pacing --model-path models/smollm2-135m-instruct-q4_1 \\
        --streams 6 --long 3 --long-tokens 3000 --gap 12 --rounds 1 --json /tmp/pacing.json

Per mode and round it measures:
- alone: each long prompt's time to first token with nothing else running (other random prompts
  of the same length, so the mixed phase never hits the prefix cache);
- quiet: the same streams (as many, as long) decoding with no prompt arriving: their inter-token gaps,
  whole, and **matched**: the gaps at the very token indices (the same stream, the same output token)
  of the mixed phase's gaps below. A decode step grows with its rows' context (each row reads its
  whole KV), so the streams' p99 at 1,000-1,500 tokens of context is not their p99 at 100: the matched
  p99 is the one "without the arrivals" means, the same steps with nothing arriving;
- mixed: the streams decoding while the long prompts arrive `--gap` seconds apart: the streams'
  inter-token gaps that end while a long prompt is between its arrival and its first token, each
  long prompt's time to first token, and the workload's throughput (prompt and output tokens of every request
  over the time from the first stream's start to the last request's end).
Gaps are per token as the output thread hands them out (stream_interval 1).

`--trace FILE` writes one JSON line per step that had decode rows and prompt tokens, and per cap the
pacer set: the step's shape, its wall time, what the step model predicted for it before learning from
it, the target and the slow start's bound (what the first GPU run needed to see why its paced steps
were ~100 a prompt where a synthetic device with its prices gives 3).
"""
from __future__ import annotations

import argparse
import json
import random
import threading
import time
from typing import Optional, Sequence

import numpy as np

from backend.core.config import EngineConfig
from backend.core.sampling_params import SamplingParams
from backend.engine.async_engine import AsyncEngine
from backend.sched import pacing as pacing_mod
from backend.sched.step_cost import step_features

MODES = {"paced": {}, "unpaced": {"inter_token_target_ms": 0.0}}


class Tracker:
    """Each request's token arrival times, from the output callbacks."""

    def __init__(self):
        self.times: dict[str, list[float]] = {}
        self.started: dict[str, float] = {}
        self.done: dict[str, threading.Event] = {}

    def add(self, engine: AsyncEngine, rid: str, prompt: list[int], max_tokens: int) -> None:
        self.times[rid], self.done[rid] = [], threading.Event()
        self.started[rid] = time.perf_counter()

        def on_output(out) -> None:
            now = time.perf_counter()
            self.times[rid].extend([now] * len(out.new_token_ids))
            if out.finished:
                self.done[rid].set()

        engine.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True), on_output)

    def ttft(self, rid: str) -> float:
        return self.times[rid][0] - self.started[rid]

    def gaps(self, rids: Sequence[str], since: float, until: float) -> list[float]:
        return list(self.indexed_gaps(rids, since, until).values())

    def indexed_gaps(self, rids: Sequence[str], since: float, until: float) -> dict[tuple[int, int], float]:
        """The gaps that end in [since, until], keyed by (the stream's place in rids, the index of the
        token that ends the gap)."""
        out = {}
        for i, rid in enumerate(rids):
            t = self.times[rid]
            out.update({(i, k + 1): b - a for k, (a, b) in enumerate(zip(t, t[1:])) if since <= b <= until})
        return out


def matched(quiet: dict[tuple[int, int], float], during: dict[tuple[int, int], float]) -> list[float]:
    """The quiet phase's gaps at the keys (stream, token index) of the mixed phase's gaps."""
    return [quiet[k] for k in during if k in quiet]


def prompt_of(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(10, vocab - 10) for _ in range(n)]


class PacerTrace:
    """Records the pacer's caps and the paced steps it learns from (Pacer.prefill_cap and
    Pacer.observe, wrapped while the context is open) as JSON lines tagged with the turn."""

    def __init__(self, path: Optional[str]):
        self.file = open(path, "w") if path else None
        self.turn = ""

    def _write(self, **row) -> None:
        self.file.write(json.dumps(dict(turn=self.turn, t=time.perf_counter(), **row)) + "\n")

    def __enter__(self) -> "PacerTrace":
        if self.file is None:
            return self
        trace, cls = self, pacing_mod.Pacer
        self.saved = cls.prefill_cap, cls.observe
        cap, observe = self.saved

        def traced_cap(pacer, rows, start, kv=None):
            out = cap(pacer, rows, start, kv)
            if out is not None:
                trace._write(kind="cap", rows=rows, start=start, kv=kv, cap=out, trusted=pacer.trusted,
                             target_s=pacer.target_seconds(rows, kv), decode_s=pacer.cost.decode_seconds(rows, kv),
                             prices=list(pacer.cost.prices()))
            return out

        def traced_observe(pacer, decode_rows, prompt_tokens, pairs, seconds, decode_kv=0.0):
            if decode_rows and prompt_tokens and pacer.cost.prompt_steps:
                x = step_features(decode_rows, prompt_tokens, pairs, decode_kv)
                trace._write(kind="step", rows=decode_rows, tokens=prompt_tokens, pairs=pairs, kv=decode_kv,
                             seconds=seconds, predicted_s=pacer.cost.predict(x), trusted=pacer.trusted)
            return observe(pacer, decode_rows, prompt_tokens, pairs, seconds, decode_kv)

        cls.prefill_cap, cls.observe = traced_cap, traced_observe
        return self

    def __exit__(self, *exc) -> None:
        if self.file is not None:
            pacing_mod.Pacer.prefill_cap, pacing_mod.Pacer.observe = self.saved
            self.file.close()


def run_mode(args, overrides: dict, seed: int) -> dict:
    config = EngineConfig(model_path=args.model_path, max_model_len=args.max_model_len, **overrides)
    engine = AsyncEngine(config)
    try:
        rng, vocab = random.Random(seed), engine.vocab_size
        t = Tracker()
        t.add(engine, "warm", prompt_of(rng, 64, vocab), 4)
        t.done["warm"].wait()
        alone = []
        for i in range(args.long):  # alone: nothing else runs
            rid = f"alone{i}"
            t.add(engine, rid, prompt_of(rng, args.long_tokens, vocab), 1)
            t.done[rid].wait()
            alone.append(t.ttft(rid))
        streams = [f"quiet{i}" for i in range(args.streams)]
        for rid in streams:
            t.add(engine, rid, prompt_of(rng, args.stream_prompt, vocab), args.stream_tokens)
        for rid in streams:
            t.done[rid].wait()
        quiet_at = t.indexed_gaps(streams, 0.0, float("inf"))
        quiet = list(quiet_at.values())
        streams = [f"s{i}" for i in range(args.streams)]
        begin = time.perf_counter()
        for rid in streams:
            t.add(engine, rid, prompt_of(rng, args.stream_prompt, vocab), args.stream_tokens)
        while any(len(t.times[r]) < 8 for r in streams):  # every stream decoding
            time.sleep(0.01)
        longs = []
        for i in range(args.long):
            if i:
                time.sleep(args.gap)
            rid = f"long{i}"
            t.add(engine, rid, prompt_of(rng, args.long_tokens, vocab), args.long_output)
            longs.append(rid)
        for rid in longs:
            t.done[rid].wait()
        during_at = {}  # gaps that end while a long prompt is on its way to its first token
        for rid in longs:
            during_at.update(t.indexed_gaps(streams, t.started[rid], t.times[rid][0]))
        during = list(during_at.values())
        quiet_matched = matched(quiet_at, during_at)
        for rid in streams:
            t.done[rid].wait()
        end = max(t.times[r][-1] for r in streams + longs)
        tokens = sum(args.stream_prompt + args.stream_tokens for _ in streams) + \
            sum(args.long_tokens + args.long_output for _ in longs)
        return {"alone_ttft_s": alone, "mixed_ttft_s": [t.ttft(r) for r in longs],
                "quiet_itl_p50_s": pct(quiet, 50), "quiet_itl_p99_s": pct(quiet, 99),
                "quiet_matched_itl_p50_s": pct(quiet_matched, 50), "quiet_matched_itl_p99_s": pct(quiet_matched, 99),
                "during_itl_p50_s": pct(during, 50), "during_itl_p99_s": pct(during, 99),
                "during_itl_max_s": max(during) if during else None, "during_gaps": len(during),
                "throughput_tok_s": tokens / (end - begin), "makespan_s": end - begin}
    finally:
        engine.shutdown()


def pct(values: Sequence[float], q: float) -> Optional[float]:
    return float(np.percentile(values, q)) if values else None


def paced_overrides(pairs: Sequence[str], flag: str = "--paced-param") -> dict:
    """KEY=VALUE pairs (--paced-param, --param) as EngineConfig overrides, typed and checked as
    config.pbtxt's parameters are (EngineConfig.typed_overrides)."""
    params = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"{flag} {pair!r}: KEY=VALUE with KEY an engine setting")
        params[key] = value
    try:
        return EngineConfig.typed_overrides(params)
    except ValueError as exc:
        raise SystemExit(f"{flag}: {exc}") from None


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m client.tools.benchmarks.pacing", description=__doc__.split("\n")[0])
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--streams", type=int, default=6)
    ap.add_argument("--stream-prompt", type=int, default=37)
    ap.add_argument("--stream-tokens", type=int, default=1500, help="each stream's output (quiet and mixed phases)")
    ap.add_argument("--long", type=int, default=3, help="long prompts arriving")
    ap.add_argument("--long-tokens", type=int, default=3000)
    ap.add_argument("--long-output", type=int, default=16)
    ap.add_argument("--gap", type=float, default=12.0, help="seconds between two long prompts' arrivals")
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--rounds", type=int, default=1, help="each round runs paced, unpaced, unpaced, paced")
    ap.add_argument("--paced-param", action="append", default=[], metavar="KEY=VALUE",
                    help="an engine setting for the paced turns only (e.g. inter_token_auto_factor=2.5): "
                         "the default's neighbours, measured against the same unpaced turns")
    ap.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                    help="an engine setting for every turn (e.g. max_tokens_in_paged_kv_cache=200000 on a GPU, "
                         "where each turn's engine would otherwise size its KV cache from the free memory)")
    ap.add_argument("--json", help="write every run's figures here (rewritten after each turn)")
    ap.add_argument("--trace", help="write the pacer's caps and paced steps here, a JSON line each")
    return ap


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    common = paced_overrides(args.param, "--param")
    modes = {mode: {**common, **over} for mode, over in {**MODES, "paced": paced_overrides(args.paced_param)}.items()}
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    with PacerTrace(args.trace) as trace:
        for r in range(args.rounds):
            for i, mode in enumerate(("paced", "unpaced", "unpaced", "paced")):
                trace.turn = f"{r}.{i}.{mode}"
                _turn(args, modes, runs, mode, seed=1000 * r + i)
    return 0


def _turn(args, modes: dict, runs: dict, mode: str, seed: int) -> None:
    """One engine's turn: its figures printed, and the JSON rewritten (a cut run keeps its turns)."""
    res = run_mode(args, modes[mode], seed=seed)
    runs[mode].append(res)
    print(mode, json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in res.items()
                            if not isinstance(v, list)}), flush=True)
    print("  ttft alone", [round(x, 2) for x in res["alone_ttft_s"]], "mixed",
          [round(x, 2) for x in res["mixed_ttft_s"]], flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "runs": runs}, f, indent=1)


if __name__ == "__main__":
    raise SystemExit(main())
