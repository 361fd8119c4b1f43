"""The metrics as Prometheus' text exposition carries them, read back: `parse_exposition` turns a
/metrics page (Triton's port, the OpenAI port's) into its samples, each a name, its labels (escapes
undone) and a value; `matching` picks a name's samples by their labels. The one reader of that
format here: the OpenAI port's gateway metrics, the benchmarks' and the soak's scrapes, the GPU check
and the served tests (tests/e2e/series.py) read pages through it. Plain data, no torch."""
from __future__ import annotations

import re
import urllib.request
from dataclasses import dataclass

_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+-?\d+)?$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')
_ESCAPED = re.compile(r'\\[\\"n]')
_UNESCAPE = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}


@dataclass(frozen=True)
class Sample:
    name: str
    labels: dict
    value: float


def parse_exposition(text: str) -> list[Sample]:
    """Prometheus text exposition -> its samples (comments and malformed lines skipped)."""
    out = []
    for line in text.splitlines():
        m = _LINE.match(line.strip())
        if m is None or line.startswith("#"):
            continue
        labels = {k: _ESCAPED.sub(lambda e: _UNESCAPE[e.group(0)], v) for k, v in _LABEL.findall(m.group(2) or "")}
        try:
            out.append(Sample(m.group(1), labels, float(m.group(3))))
        except ValueError:
            continue
    return out


def matching(samples: list[Sample], name: str, **labels: str) -> list[Sample]:
    """`name`'s samples whose labels include `labels` (equal values)."""
    return [s for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]


def read_page(url: str, timeout: float = 5.0) -> list[Sample]:
    """The samples of the /metrics page at `url`."""
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return parse_exposition(r.read().decode())
