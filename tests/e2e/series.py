"""The inflight_* series a served test reads on a server's metrics port, through templates.exposition
(the one reader of Prometheus' text format here): a gauge or counter summed over the series whose
labels match, the names exported, the samples themselves."""
from __future__ import annotations

from templates.exposition import Sample, matching, read_page
from templates.metrics import PREFIX


def samples(server) -> list[Sample]:
    """Every inflight_* sample on `server`'s metrics port."""
    return [s for s in read_page(server.metrics_url, timeout=10) if s.name.startswith(PREFIX)]


def gauge(server, name: str, **labels: str) -> float:
    """The sum of `name`'s series whose labels include `labels` (every instance, model and adapter
    unless a label says which); KeyError when the server exports none."""
    found = matching(samples(server), name, **labels)
    if not found:
        raise KeyError(f"{name}{labels or ''}")
    return sum(s.value for s in found)


def names(server) -> set[str]:
    """The inflight_* sample names `server` exports."""
    return {s.name for s in samples(server)}
