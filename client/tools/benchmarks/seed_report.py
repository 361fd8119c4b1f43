"""The seed's three latency claims (issue 45, Build item 4): each claim's verdict from its rows,
its markdown table and its plot. No engine here: client/tools/benchmarks/seed_claims.py measures
the rows, tests/test_seed_claims.py checks these functions on hand-made rows.

Rows are dicts. max-seqs: one per `max_num_seqs` (measure.summarize's keys plus the sampled gauges).
long-prompts: one per (config, prompt length): the streams' inter-token gaps while the prompt was
on its way to its first token (`itl_p50_s`, `itl_p99_s`, `itl_max_s`), the quiet p99 before it,
and the prompt's `ttft_s`. goodput: one per batching mode with its `goodput_rps` and `instances`.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Sequence

SEED_INSTANCES = (8, 2)  # the seed's client: 8 GPUs before continuous batching, 2 after


def _ms(v: Optional[float]) -> str:
    return "-" if v is None else f"{v * 1000:,.0f}"


def _pc(v: Optional[float], digits: int = 0) -> str:
    return "-" if v is None else f"{100 * v:.{digits}f}%"


def _num(v: Optional[float], fmt: str = ".1f") -> str:
    return "-" if v is None else format(v, fmt)


def _table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "| " + " | ".join("---" for _ in head) + " |"]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


# -- claim 1: p99 against max_num_seqs ---------------------------------------------------------------
def verdict_max_seqs(rows: Sequence[dict], rise: float = 1.25, kv_full: float = 0.9) -> tuple[str, str]:
    """Does a larger max_num_seqs raise p99, and is the KV cache why? The base is the max_num_seqs
    with the lowest TTFT p99; the first larger one whose TTFT or ITL p99 exceeds `rise` x the base's
    is where p99 rises. Reproduced when it rises there with the cache full (peak >= kv_full) or
    requests preempted; refuted otherwise (no rise, or a rise without KV competition)."""
    rows = sorted((r for r in rows if r.get("ttft_p99_s") is not None), key=lambda r: r["max_num_seqs"])
    if not rows:
        return "refuted", "no run measured a TTFT"
    base = min(rows, key=lambda r: r["ttft_p99_s"])

    def worse(r: dict, key: str) -> bool:
        return r.get(key) is not None and base.get(key) is not None and r[key] > rise * base[key]

    risen = [r for r in rows if r["max_num_seqs"] > base["max_num_seqs"]
             and (worse(r, "ttft_p99_s") or worse(r, "itl_p99_s"))]
    if base is rows[-1]:
        return "refuted", (f"the largest max_num_seqs ({base['max_num_seqs']}) had the lowest TTFT p99 "
                           f"({_ms(base['ttft_p99_s'])} ms; ITL p99 {_ms(base.get('itl_p99_s'))} ms)")
    if not risen:
        return "refuted", (f"no max_num_seqs above {base['max_num_seqs']} raised TTFT or ITL p99 above {rise:g}x "
                           f"its (TTFT p99 {_ms(base['ttft_p99_s'])} ms, ITL p99 {_ms(base.get('itl_p99_s'))} ms)")
    r = risen[0]
    kv = (r.get("kv_usage_peak") or 0.0) >= kv_full or bool(r.get("preemptions"))
    figures = (f"from max_num_seqs {base['max_num_seqs']} to {r['max_num_seqs']} TTFT p99 {_ms(base['ttft_p99_s'])} -> "
               f"{_ms(r['ttft_p99_s'])} ms, ITL p99 {_ms(base.get('itl_p99_s'))} -> {_ms(r.get('itl_p99_s'))} ms; "
               f"KV peak {_pc(base.get('kv_usage_peak'), 1)} -> {_pc(r.get('kv_usage_peak'), 1)}, mean running "
               f"{_num(base.get('running_mean'))} -> {_num(r.get('running_mean'))}, mean waiting "
               f"{_num(base.get('waiting_mean'))} -> {_num(r.get('waiting_mean'))}, preemptions {r.get('preemptions')}")
    if kv:
        return "reproduced", "p99 rises with the KV cache full: " + figures
    return "refuted", (f"p99 rises but the KV cache is not full (peak < {_pc(kv_full)}, no preemption): the larger "
                       "batch's compute or its queue, not KV competition: " + figures)


def table_max_seqs(rows: Sequence[dict]) -> str:
    head = ("max_num_seqs", "TTFT p50 / p99 ms", "ITL p50 / p99 ms", "out tok/s", "KV peak / mean", "running mean",
            "waiting mean / peak", "preemptions", "failed")
    return _table(head, [(str(r["max_num_seqs"]), f"{_ms(r['ttft_p50_s'])} / {_ms(r['ttft_p99_s'])}",
                          f"{_ms(r['itl_p50_s'])} / {_ms(r['itl_p99_s'])}", _num(r.get("output_tokens_per_s"), ".0f"),
                          f"{_pc(r.get('kv_usage_peak'))} / {_pc(r.get('kv_usage_mean'))}", _num(r.get("running_mean")),
                          f"{_num(r.get('waiting_mean'))} / {_num(r.get('waiting_peak'), '.0f')}",
                          str(r.get("preemptions")), str(r.get("failed")))
                         for r in sorted(rows, key=lambda r: r["max_num_seqs"])])


# -- claim 2: decodes while long prompts arrive -------------------------------------------------------
def verdict_long_prompts(rows: Sequence[dict], factor: float = 2.0) -> tuple[str, str]:
    """Do long prompts block decode without chunking? Reproduced when, at every prompt length, the
    unchunked streams' ITL p99 is >= `factor` x the best chunked (or paced) config's."""
    lengths = sorted({r["prompt_tokens"] for r in rows})
    parts, blocked = [], []
    for n in lengths:
        at = {r["config"]: r for r in rows if r["prompt_tokens"] == n and r.get("itl_p99_s") is not None}
        if "unchunked" not in at or len(at) < 2:
            continue
        best = min((r for c, r in at.items() if c != "unchunked"), key=lambda r: r["itl_p99_s"])
        ratio = at["unchunked"]["itl_p99_s"] / best["itl_p99_s"]
        blocked.append(ratio >= factor)
        parts.append(f"{n:,} tokens: unchunked {_ms(at['unchunked']['itl_p99_s'])} ms vs {best['config']} "
                     f"{_ms(best['itl_p99_s'])} ms ({ratio:.1f}x)")
    if not blocked:
        return "refuted", "no length measured both unchunked and chunked"
    word = "reproduced" if all(blocked) else "refuted"
    return word, f"streams' ITL p99 while a prompt arrives, unchunked vs the best chunked: {'; '.join(parts)}"


def table_long_prompts(rows: Sequence[dict]) -> str:
    head = ("config", "prompt tokens", "streams' ITL p50 / p99 / max ms while it arrives", "quiet ITL p99 ms",
            "prompt's TTFT s", "gaps")
    return _table(head, [(r["config"], f"{r['prompt_tokens']:,}",
                          f"{_ms(r['itl_p50_s'])} / {_ms(r['itl_p99_s'])} / {_ms(r['itl_max_s'])}",
                          _ms(r.get("quiet_itl_p99_s")),
                          f"> {r.get('waited_s') or 0:.0f} (cut)" if r.get("cut") else _num(r.get("ttft_s"), ".2f"),
                          str(r["gaps"]))
                         for r in rows])


# -- claim 3: goodput and instances -------------------------------------------------------------------
def verdict_goodput(rows: Sequence[dict]) -> tuple[str, str]:
    """Continuous batching's instance saving against the best request-level mode (static, dynamic or
    none): reproduced when it is >= the seed's 8 -> 2 (4x); undecided while either side's search
    found no rate that missed (its goodput only a lower bound)."""
    by = {r["mode"]: r for r in rows}
    after = by.get("inflight", {}).get("instances")
    before = [(r["instances"], m) for m, r in by.items() if m != "inflight" and r.get("instances")]
    if not after or not before:
        return "refuted", "in-flight or every other mode met the SLO at no rate tried"
    fewest, mode = min(before)
    ratio = fewest / after
    seed = SEED_INSTANCES[0] / SEED_INSTANCES[1]
    word = "reproduced" if ratio >= seed else "refuted"
    text = (f"in-flight needs {after} instances, the best other mode ({mode}) {fewest}: {ratio:.1f}x fewer "
            f"(the seed: {SEED_INSTANCES[0]} -> {SEED_INSTANCES[1]}, {seed:.0f}x)")
    open_ended = [m for m in ("inflight", mode) if by[m].get("lowest_missed_rps") is None]
    if open_ended:  # a goodput no rate above missed is only a lower bound: the instances an upper one
        return "undecided", (text + f"; but {' and '.join(open_ended)} met the SLO at every rate tried, so "
                             "its goodput is a lower bound (raise --max-runs or --rate)")
    return word, text


def table_goodput(rows: Sequence[dict], target_rpm: float) -> str:
    head = ("mode", "goodput req/s", "req/min", "lowest rate that missed", "rates tried", f"instances for {target_rpm:,.0f}/min")
    return _table(head, [(r["mode"], _num(r.get("goodput_rps"), ".2f"),
                          _num(r["goodput_rps"] * 60 if r.get("goodput_rps") else None, ".0f"),
                          _num(r.get("lowest_missed_rps"), ".2f"), str(len(r.get("runs", []))),
                          str(r.get("instances") or "none met the SLO")) for r in rows])


# -- plots --------------------------------------------------------------------------------------------
def plot(claim: str, rows: Sequence[dict], path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    if claim == "max-seqs":
        rows = sorted(rows, key=lambda r: r["max_num_seqs"])
        x = [r["max_num_seqs"] for r in rows]
        for ax, key, name in ((axes[0], "ttft", "time to first token"), (axes[1], "itl", "inter-token latency")):
            for q, style in (("p50", "o--"), ("p99", "o-")):
                ax.plot(x, [_s(r.get(f"{key}_{q}_s")) for r in rows], style, label=q)
            ax.set(xscale="log", xlabel="max_num_seqs", ylabel="ms", title=name)
            ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
            ax.set_xticks(x, [str(v) for v in x])
            kv = ax.twinx()
            kv.plot(x, [100 * (r.get("kv_usage_peak") or 0) for r in rows], "s:", color="grey", label="KV peak %")
            kv.set(ylabel="KV peak %", ylim=(0, 105))
            ax.legend(loc="upper left")
    elif claim == "long-prompts":
        configs = list(dict.fromkeys(r["config"] for r in rows))
        lengths = sorted({r["prompt_tokens"] for r in rows})
        width = 0.8 / max(1, len(configs))
        for i, c in enumerate(configs):
            at = {r["prompt_tokens"]: r for r in rows if r["config"] == c}
            xs = [j + i * width for j in range(len(lengths))]
            axes[0].bar(xs, [_s(at.get(n, {}).get("itl_p99_s")) for n in lengths], width, label=c)
            bars = axes[1].bar(xs, [(at.get(n, {}).get("ttft_s") or at.get(n, {}).get("waited_s") or 0)
                                    for n in lengths], width, label=c)
            for bar, n in zip(bars, lengths):  # cut at the window: the TTFT is longer than the bar
                if at.get(n, {}).get("cut"):
                    bar.set_hatch("//")
        for ax, name, unit in ((axes[0], "streams' ITL p99 while a prompt arrives", "ms"),
                               (axes[1], "the long prompt's TTFT (hatched: cut, longer)", "s")):
            ax.set_xticks([j + 0.4 - width / 2 for j in range(len(lengths))], [f"{n:,}" for n in lengths])
            ax.set(yscale="log", xlabel="prompt tokens", ylabel=unit, title=name)
        axes[0].legend(fontsize=8)
    else:
        modes = [r["mode"] for r in rows]
        axes[0].bar(modes, [r.get("goodput_rps") or 0 for r in rows])
        axes[0].set(ylabel="requests/s", title="goodput (highest rate meeting the SLO)")
        axes[1].bar(modes, [r.get("instances") or 0 for r in rows], color="tab:orange")
        axes[1].set(ylabel="instances", title="instances for the target load")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _s(v: Optional[float]) -> float:
    return float("nan") if v is None else v * 1000


def markdown(claim: str, rows: Sequence[dict], meta: dict[str, Any]) -> str:
    """The claim's section body: command, conditions, table, verdict."""
    if claim == "max-seqs":
        table, (word, why) = table_max_seqs(rows), verdict_max_seqs(rows)
    elif claim == "long-prompts":
        table, (word, why) = table_long_prompts(rows), verdict_long_prompts(rows)
    else:
        table, (word, why) = table_goodput(rows, meta["target_rpm"]), verdict_goodput(rows)
    return (f"```\n{meta['command']}\n```\n\n{meta['machine']}, {meta['date']}, load average {meta['load']}.\n\n"
            f"{table}\n\n**{word}**: {why}.\n")
