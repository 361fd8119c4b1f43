"""What every peer runner shares: its arguments, the workload file and the result file. Plain
standard library, so the runners import it from the peer venvs too (by path, see run_vllm.py)."""
from __future__ import annotations

import argparse
import ctypes
import json
import resource
import signal
from pathlib import Path
from typing import Optional


def die_with_parent() -> None:
    """A `preexec_fn`: the child gets SIGTERM when the process that started it ends, however it ends
    (Linux's PR_SET_PDEATHSIG). The table starts a runner, a runner starts llama-server in its own
    session: stopping the table (Ctrl-C, kill) used to leave the runner and a 2-thread llama-server
    spinning, which skewed every later measurement on the machine."""
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)


def parse_runner_args(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--model-path", required=True)
    p.add_argument("--workload", type=Path, required=True, help="JSON: [{'input_ids': [...], 'max_tokens': n}]")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--warmup", type=int, default=4, help="untimed requests (4 output tokens each) first")
    p.add_argument("--concurrency", type=int, default=0,
                   help="requests in flight at once: 0 all at once, 1 one at a time in turn")
    p.add_argument("--dtype", default="auto", help="inflight only: its dtype parameter")
    return p.parse_args(argv)


def load_workload(path: Path) -> list[tuple[list[int], int]]:
    return [(r["input_ids"], r["max_tokens"]) for r in json.loads(Path(path).read_text())]


def warmup_items(items: list[tuple[list[int], int]], n: int) -> list[tuple[list[int], int]]:
    """The untimed requests: the first ``n`` prompts rotated by one token (so they share no prefix
    with the timed ones, which a prefix cache would otherwise skip the prefill of), 4 tokens each."""
    return [(p[1:] + p[:1], 4) for p, _ in items[:n]]


def write_result(path: Path, engine: str, elapsed_s: float, output_lens: list[int],
                 items: list[tuple[list[int], int]], peak_rss_mb: Optional[float] = None,
                 extra: Optional[dict] = None) -> None:
    """The run's figures; ``peak_rss_mb`` defaults to the peak resident memory of this process or of
    the largest child it has reaped (vLLM's engine core runs in one), whichever is larger.
    ``prompt_tok_s`` is prompt tokens over the whole run: the prefill rate when every request asks
    for one output token (``--output-len 1``). ``extra``: the engine's own figures, stored as given."""
    if peak_rss_mb is None:
        peak_rss_mb = max(resource.getrusage(who).ru_maxrss for who in
                          (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)) / 1024  # KiB on Linux
    expected = [n for _, n in items]
    if output_lens != expected:  # ignore_eos: a peer that stops early would look faster
        wrong = sum(a != b for a, b in zip(output_lens, expected))
        raise SystemExit(f"{engine}: {wrong} of {len(items)} requests did not generate their max_tokens")
    out_tokens = sum(output_lens)
    prompt_tokens = sum(len(p) for p, _ in items)
    Path(path).write_text(json.dumps({
        "engine": engine, "elapsed_s": elapsed_s, "requests": len(items), "prompt_tokens": prompt_tokens,
        "output_tokens": out_tokens, "output_tok_s": out_tokens / elapsed_s,
        "total_tok_s": (out_tokens + prompt_tokens) / elapsed_s, "prompt_tok_s": prompt_tokens / elapsed_s,
        "peak_rss_mb": peak_rss_mb, **(extra or {})}))
