"""The PNG of a peers table (table.py's JSON): per inflight build a panel (log scale), per row a group of bars,
one bar a column (the median ratio inflight / its llama.cpp peer over the cell's rounds, each round a dot),
the issue's target for that cell a black tick over its bar, 1.0x (parity) a dashed line."""
from __future__ import annotations

import textwrap
from pathlib import Path

from client.tools.peers.table_rows import COLUMNS

COLUMN_LABELS = {"single": "single stream", "batch32": "32 at once", "prompt_short": "prompt short (TTFT)",
                 "prompt_long": "prompt long (TTFT)", "decode_ctx": "decode at context"}


def plot(report: dict, path: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    builds = [e for e in report["engines"] if not e.startswith("llamacpp")]
    peers = report.get("peers", {})
    sizes = report.get("sizes", {})
    short, long_ = sizes.get("prompt_lens", ("short", "long"))
    labels = {**COLUMN_LABELS, "batch32": f"{sizes.get('batch_requests', 32)} at once", "prompt_short": f"prompt {short} (TTFT)", "prompt_long": f"prompt {long_} (TTFT)",
              "decode_ctx": f"decode at {sizes.get('decode_context', '')} context"}
    rows = report["rows"]
    fig, axes = plt.subplots(len(builds), 1, figsize=(max(8.0, 1.9 * len(rows) + 2), 3.6 * len(builds) + 1.2),
                             squeeze=False)
    width = 0.8 / len(COLUMNS)
    colors = plt.get_cmap("tab10").colors
    top, bottom = 1.0, 1.0
    for ax, build in zip(axes[:, 0], builds):
        for i, row in enumerate(rows):
            cells = {c["column"]: c for c in row["cells"]}
            for j, column in enumerate(COLUMNS):
                x = i - 0.4 + width * (j + 0.5)
                cell = cells.get(column)
                if cell is None:
                    continue
                values = cell["ratios"].get(build) or []
                top = max([top, cell["target"] or 0, *values])
                bottom = min([bottom, *values])
                median = cell["median"].get(build)
                if median:
                    ax.bar(x, median, width * 0.9, color=colors[j], label=labels[column])
                    ax.plot([x] * len(values), values, "k.", markersize=3)
                else:
                    ax.text(x, 1.0, "failed", rotation=90, ha="center", va="center", fontsize=7)
                if cell["target"]:
                    ax.plot([x - width / 2, x + width / 2], [cell["target"]] * 2, color="black", linewidth=2)
        ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
        ax.set_xticks(range(len(rows)))
        ax.set_xticklabels([r["label"] for r in rows], fontsize=8, rotation=12)
        peer = peers.get(build, "llamacpp")
        ax.set_ylabel(f"{build} / {peer}")
        ax.set_title(f"{build}: ratio per row and column (black tick: the issue's target)", fontsize=9)
    for ax in axes[:, 0]:  # ratios on a log scale: 0.5x and 2x equally far from parity
        ax.set_yscale("log")
        ax.set_ylim(bottom / 1.5, top * 1.5)
    handles = {}
    for ax in axes[:, 0]:
        for h, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, h)
    if handles:
        fig.legend(list(handles.values()), list(handles), fontsize=7, ncol=len(handles), loc="lower center")
    machine = report["machine"]
    flags = " ".join(f for f, on in machine["isa_flags"].items() if on)
    title = (f"{machine['cpu_model']} ({flags}); {report['threads']} threads; {report['started']}"
             + (" — SMOKE sizes, not a claim" if report.get("smoke") else ""))
    # wrapped to the figure's width (~14 characters an inch at 9 points): a long flag list was cut off
    fig.suptitle("\n".join(textwrap.wrap(title, int(fig.get_figwidth() * 14))), fontsize=9)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)
