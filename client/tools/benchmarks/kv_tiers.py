"""Multi-turn chat with and without KV tiers, interleaved in one run (docs/performance.md, "KV-cache tiers").

    python -m client.tools.benchmarks.kv_tiers --json /tmp/kv-tiers.json        # SmolLM2, 64 x 6

`--conversations` conversations share one system prompt; each turn appends a user message
(`--user-tokens` random words) to the conversation's history, and the answer (`--max-tokens`
greedy tokens) joins the history for the next turn. Turns run turn-major (every conversation's
turn 1, then every turn 2, ...) at `--concurrency` requests in flight, so between two turns of a
conversation all the others pass through the KV cache (`--kv-tokens`, far less than the
conversations' state): without tiers a returning turn recomputes its history; with them its
blocks come back from host memory (`--host-bytes`) or disk (`disk`: `--disk-host-bytes` of host
in front of the disk tier).

Each configuration (`--configs`: none, host, disk; `host:always`, `disk:never`, ... also set
kv_tier_load_policy, whose default is auto; `device`: no tier, a KV cache of `--device-kv-tokens`
that holds every history, the answers a tier must give) is its own engine in this process; every turn
runs once per configuration, in an order that alternates from turn to turn, so that the machine's
load falls on all of them alike. Reported per configuration: time to first token of first turns
and of returning turns (p50, p99), the tiers' hits and bytes, whether every answer equals the
first configuration's, and `device`'s when it ran, token for token (greedy), and the leak check after the workload (no block
used, nothing pinned or in flight, the engine's check_integrity); with it the CPU model, its ISA and
the load average before and after (the machine may be shared).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np

from kernels.cpuinfo import cpu_flags, cpu_model

from backend import EngineConfig, SamplingParams
from backend.engine.llm_engine import LLMEngine
from templates.render import parse_param

DEFAULT_MODEL = "models/smollm2-135m-instruct"
WORDS = ("river stone market engine garden letter window morning orange silver paper bridge forest "
         "question answer village summer number winter doctor castle planet music story island "
         "mountain teacher animal kitchen garden ocean picture season travel").split()


def conversations(tokenizer, n: int, system_tokens: int, seed: int) -> tuple[list[int], random.Random]:
    rng = random.Random(seed)
    text = "You are a helpful assistant. " + " ".join(rng.choice(WORDS) for _ in range(system_tokens))
    return tokenizer.encode(text)[:system_tokens], rng


def user_turns(tokenizer, rng: random.Random, n: int, turns: int, lo: int, hi: int,
               document: int = 0) -> list[list[list[int]]]:
    """[conversation][turn] -> the user message's tokens (drawn once: every configuration sends the same).
    `document`: each conversation's first message starts with a document of its own of that many
    tokens (a long history per conversation, as a user who pastes a file has)."""
    def message(words: int) -> list[int]:
        return tokenizer.encode(" " + " ".join(rng.choice(WORDS) for _ in range(words)), add_special_tokens=False)
    out = [[message(rng.randint(lo, hi)) for _ in range(turns)] for _ in range(n)]
    if document:
        for turns_of in out:
            turns_of[0] = message(document)[:document] + turns_of[0]
    return out


class Chat:
    """One configuration: its engine and every conversation's history."""

    def __init__(self, name: str, config: EngineConfig, system: list[int], n: int):
        self.name = name
        self.engine = LLMEngine(config)
        self.history = [list(system) for _ in range(n)]
        self.answers: dict[tuple[int, int], list[int]] = {}
        self.ttft: dict[int, list[float]] = {}  # turn -> seconds
        self.cached: dict[int, list[int]] = {}  # turn -> cached prompt tokens per request
        self.busy_s = 0.0

    def run_turn(self, turn: int, users: list[list[list[int]]], params: SamplingParams, concurrency: int) -> None:
        engine, todo, active = self.engine, list(range(len(users))), {}
        start = time.perf_counter()
        while todo or active:
            while todo and len(active) < concurrency:
                c = todo.pop(0)
                self.history[c] += users[c][turn]
                active[c] = engine.add_request(f"{self.name}-{c}-{turn}", list(self.history[c]), params)
            engine.step()
            for c, req in list(active.items()):
                if req.status.finished:
                    self.ttft.setdefault(turn, []).append(req.first_token_time - req.arrival_time)
                    self.cached.setdefault(turn, []).append(req.num_cached_tokens)
                    self.answers[(c, turn)] = list(req.output_token_ids)
                    self.history[c] += req.output_token_ids
                    del active[c]
        self.busy_s += time.perf_counter() - start

    def report(self, turns: int) -> dict[str, Any]:
        returning = [t for turn in range(1, turns) for t in self.ttft.get(turn, [])]
        stats = self.engine.stats()
        tiers = self.engine.kv_tiers
        self.engine.check_integrity()
        idle = stats["kv_blocks_used"] == 0 and tiers.idle
        pct = lambda xs, q: float(np.percentile(xs, q)) if xs else None  # noqa: E731
        return {"first_turn_ttft_p50_s": pct(self.ttft.get(0, []), 50), "first_turn_ttft_p99_s": pct(self.ttft.get(0, []), 99),
                "returning_ttft_p50_s": pct(returning, 50), "returning_ttft_p99_s": pct(returning, 99),
                "returning_requests": len(returning), "busy_s": self.busy_s,
                "cached_tokens_returning": sum(sum(self.cached.get(t, [])) for t in range(1, turns)),
                "prefix_cache_hit_tokens": stats["prefix_cache_hit_tokens"], "kv_tiers": stats.get("kv_tiers"),
                "idle_after_workload": idle}


def tier_settings(tiers: dict[str, dict], name: str) -> dict[str, Any]:
    """A configuration's settings: its tier's, and `:policy` as kv_tier_load_policy."""
    tier, _, policy = name.partition(":")
    return {**tiers[tier], **({"kv_tier_load_policy": policy} if policy else {})}


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m client.tools.benchmarks.kv_tiers", description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default=DEFAULT_MODEL)
    p.add_argument("--configs", default="none,host",
                   help="comma-separated: none, host, disk, each tier with an optional :auto, :always or :never")
    p.add_argument("--conversations", type=int, default=64)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--system-tokens", type=int, default=200)
    p.add_argument("--user-tokens", type=int, nargs=2, default=(16, 48), metavar=("MIN", "MAX"), help="words per user turn")
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--document-tokens", type=int, default=0,
                   help="each conversation's first message opens with a document of its own of this many tokens")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--kv-tokens", type=int, default=4096, help="the KV cache (max_tokens_in_paged_kv_cache)")
    p.add_argument("--device-kv-tokens", type=int, default=65536, help="the KV cache of `device`: every history")
    p.add_argument("--host-bytes", type=int, default=2 << 30, help="kv_host_cache_bytes of `host`")
    p.add_argument("--disk-host-bytes", type=int, default=64 << 20, help="kv_host_cache_bytes in front of `disk`")
    p.add_argument("--disk-bytes", type=int, default=4 << 30)
    p.add_argument("--disk-dir", default=None, help="default: a temporary folder, removed at the end")
    p.add_argument("--param", type=parse_param, action="append", default=[], metavar="KEY=VALUE",
                   help="another engine setting for every configuration (repeatable)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    disk_dir = tempfile.TemporaryDirectory(prefix="kv-tiers-bench-") if args.disk_dir is None else None
    tiers = {"none": {}, "device": {"max_tokens_in_paged_kv_cache": args.device_kv_tokens},
             "host": {"kv_host_cache_bytes": args.host_bytes},
             "disk": {"kv_host_cache_bytes": args.disk_host_bytes, "kv_disk_cache_bytes": args.disk_bytes,
                      "kv_disk_cache_dir": args.disk_dir or disk_dir.name}}
    names = args.configs.split(",")
    base = dict(model_path=args.model_path, max_tokens_in_paged_kv_cache=args.kv_tokens, max_num_seqs=args.concurrency,
                **EngineConfig.typed_overrides(dict(args.param)))
    load = {"loadavg_start": os.getloadavg()}
    chats = [Chat(name, EngineConfig(**{**base, **tier_settings(tiers, name)}), [], args.conversations) for name in names]
    tokenizer = chats[0].engine.tokenizer
    system, rng = conversations(tokenizer, args.conversations, args.system_tokens, args.seed)
    users = user_turns(tokenizer, rng, args.conversations, args.turns, *args.user_tokens, document=args.document_tokens)
    for chat in chats:
        chat.history = [list(system) for _ in range(args.conversations)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    for turn in range(args.turns):
        order = chats if turn % 2 == 0 else chats[::-1]
        for chat in order:
            chat.run_turn(turn, users, params, args.concurrency)
        print(f"turn {turn + 1}/{args.turns} done", file=sys.stderr, flush=True)
    results = {c.name: c.report(args.turns) for c in chats}
    first = chats[0]
    refs = [first] + [x for x in chats[1:] if x.name == "device"]  # the answers compared against
    for c in chats[1:]:
        for ref in refs:
            if ref is not c:
                same = sum(c.answers[k] == ref.answers[k] for k in ref.answers)
                results[c.name]["answers_equal_to_" + ref.name] = f"{same}/{len(ref.answers)}"
        if results[first.name]["returning_ttft_p50_s"] and results[c.name]["returning_ttft_p50_s"]:
            for q in ("p50", "p99"):
                results[c.name][f"returning_ttft_{q}_speedup"] = (results[first.name][f"returning_ttft_{q}_s"]
                                                                  / results[c.name][f"returning_ttft_{q}_s"])
    for c in chats:
        c.engine.close()
    report = {"command": " ".join(["python -m client.tools.benchmarks.kv_tiers"] + list(argv or sys.argv[1:])),
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": platform.processor() or platform.machine(),
              "cpu": cpu_model(), "avx512": "avx512f" in cpu_flags(), **load, "loadavg_end": os.getloadavg(),
              "system_tokens": len(system), "settings": vars(args), "results": results}
    text = json.dumps(report, indent=2, default=str)
    print(text)
    if args.json:
        Path(args.json).write_text(text)
    if disk_dir is not None:
        disk_dir.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
