"""How `inflight bench` reports: the table, the ratios between targets and modes, CSV, the plot,
and a one-line description of the machine."""
from __future__ import annotations

import csv
import platform
import sys
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from client.tools.benchmarks.measure import METRIC_KEYS, MODES
from kernels.cpuinfo import cpu_model

CSV_KEYS = ("target", "mode", "concurrency", "repeat", "rate", "num_requests", "completed", "failed", "duration_s",
            "output_tokens", *METRIC_KEYS, "kv_usage_peak", "kv_usage_mean", "running_mean", "preemptions", "cpu_s",
            "output_tokens_per_cpu_s")


# -- reporting ---------------------------------------------------------------------------------
def _fmt(v: Any, unit: str = "") -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if unit == "ms":
            return f"{v * 1000:.0f}"
        return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
    return str(v)


def print_table(results: Sequence[dict], out=sys.stdout) -> None:
    head = ("target", "mode", "conc", "req/s", "out tok/s", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99",
            "E2E p50", "E2E p99", "KV peak", "preempt", "failed")
    rows = [head, ("", "", "", "", "", "ms", "ms", "ms", "ms", "ms", "ms", "", "", "")]
    for r in results:
        conc = str(r["concurrency"]) + (f" #{r['repeat'] + 1}" if r.get("repeat") else "")
        rows.append((r["target"], r["mode"], conc, _fmt(r["requests_per_s"]),
                     _fmt(r["output_tokens_per_s"]), _fmt(r["ttft_p50_s"], "ms"), _fmt(r["ttft_p99_s"], "ms"),
                     _fmt(r["itl_p50_s"], "ms"), _fmt(r["itl_p99_s"], "ms"), _fmt(r["e2e_p50_s"], "ms"),
                     _fmt(r["e2e_p99_s"], "ms"),
                     "-" if r.get("kv_usage_peak") is None else f"{100 * r['kv_usage_peak']:.1f}%",
                     _fmt(r.get("preemptions")), str(r["failed"])))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    for row in rows:
        print("  ".join(c.rjust(w) if i > 1 else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))), file=out)


def ratios(results: Sequence[dict]) -> list[dict]:
    """In-flight against every other mode (same target and concurrency), and server against
    in-process (in-flight, same concurrency): output tokens/s ratios, on the means of the repeats,
    and repeat by repeat (`per_repeat`, the k-th run of one against the k-th of the other) so that
    the spread on a noisy machine shows."""
    out = []
    groups: dict[tuple, list[dict]] = {}
    for r in results:
        groups.setdefault((r["target"], r["mode"], r["concurrency"]), []).append(r)
    by = {}
    for key, rs in groups.items():  # repeats: the mean of their throughputs
        vals = [x["output_tokens_per_s"] for x in rs if x["output_tokens_per_s"]]
        by[key] = {"output_tokens_per_s": float(np.mean(vals)) if vals else None, "runs": vals}

    def ratio(kind: str, target: str, conc: int, a: dict, b: dict) -> dict:
        pairs = zip(a["runs"], b["runs"]) if len(a["runs"]) == len(b["runs"]) > 1 else ()
        return {"kind": kind, "target": target, "concurrency": conc,
                "ratio": a["output_tokens_per_s"] / b["output_tokens_per_s"],
                "per_repeat": [x / y for x, y in pairs]}

    for (target, mode, conc), r in by.items():
        if mode != "inflight" or not r["output_tokens_per_s"]:
            continue
        for other in MODES[1:]:
            o = by.get((target, other, conc))
            if o and o["output_tokens_per_s"]:
                out.append(ratio(f"inflight/{other}", target, conc, r, o))
        if target.startswith("server"):
            base = by.get(("in-process", "inflight", conc))
            if base and base["output_tokens_per_s"]:
                out.append({**ratio(f"{target}/in-process", target, conc, r, base),
                            "in_process_output_tokens_per_s": base["output_tokens_per_s"],
                            "server_output_tokens_per_s": r["output_tokens_per_s"]})
    return out


def write_csv(results: Sequence[dict], path: Path) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_KEYS, extrasaction="ignore")
        w.writeheader()
        for r in results:
            w.writerow(r)


def plot(results: Sequence[dict], path: Path, title: str = "") -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.8))
    points: dict[tuple[str, str, int], list[dict]] = {}
    for r in results:
        points.setdefault((r["target"], r["mode"], r["concurrency"]), []).append(r)
    lines: dict[tuple[str, str], list[dict]] = {}
    for (target, mode, conc), rs in points.items():  # repeats: their mean
        mean = lambda k: float(np.mean([x[k] for x in rs])) if all(x[k] is not None for x in rs) else None  # noqa: E731
        lines.setdefault((target, mode), []).append(
            {"concurrency": conc, "output_tokens_per_s": mean("output_tokens_per_s"), "e2e_p99_s": mean("e2e_p99_s")})
    for (target, mode), rs in lines.items():
        rs = sorted(rs, key=lambda r: r["concurrency"])
        label = mode if target == "in-process" else f"{mode} ({target})"
        xs = [r["concurrency"] for r in rs]
        tput = [r["output_tokens_per_s"] or 0 for r in rs]
        ax1.plot(xs, tput, marker="o", label=label)
        ax2.plot(tput, [(r["e2e_p99_s"] or float("nan")) for r in rs], marker="o", label=label)
        for r, x, y in zip(rs, tput, [(r["e2e_p99_s"] or float("nan")) for r in rs]):
            ax2.annotate(f"c={r['concurrency']}", (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax1.set(xscale="log", xlabel="concurrency (requests in flight)", ylabel="output tokens/s",
            title="throughput vs concurrency")
    ax1.set_xticks(sorted({r["concurrency"] for r in results}))
    ax1.set_xticklabels([str(c) for c in sorted({r["concurrency"] for r in results})])
    ax2.set(yscale="log", xlabel="output tokens/s", ylabel="p99 end-to-end latency (s)",
            title="p99 latency vs throughput")
    for ax in (ax1, ax2):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def machine() -> str:
    import psutil

    cpu = cpu_model()
    gpu = "no GPU"
    try:
        import torch
        if torch.cuda.is_available():
            gpu = torch.cuda.get_device_name(0)
    except Exception:
        pass
    return (f"{psutil.cpu_count()} cores ({cpu}), {psutil.virtual_memory().total / 2**30:.0f} GiB RAM, "
            f"{gpu}, {platform.system()} {platform.release()}, Python {platform.python_version()}")
