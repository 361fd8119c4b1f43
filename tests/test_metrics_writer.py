"""model_repository/llm/1/triton_outputs.py's MetricsWriter, on a fake metrics object whose every
observation is a slow IPC: the gauges stay fresh while a backlog of histogram samples drains."""
import math
import sys
import threading
import time
from statistics import median

from test_gpu_rehearsal import MODEL_PY


class SlowMetrics:
    """Each histogram observation takes `ipc` seconds (an IPC to the server under load); each gauge
    update is recorded with its time."""

    def __init__(self, ipc: float):
        self.ipc = ipc
        self.observed = 0
        self.updates: list[float] = []
        self.lock = threading.Lock()

    def observe(self, kind, seconds):
        time.sleep(self.ipc)
        self.observed += 1

    def update(self, stats):
        with self.lock:
            self.updates.append((time.monotonic(), self.observed))


def test_the_gauges_stay_fresh_while_a_backlog_of_samples_drains(frozen_heap):
    """Under load a metric IPC took long enough that 256 samples between two gauge updates held one
    instance's running gauge at 0 for the whole of a test's requests. The samples now get half the
    interval, whatever an IPC costs: with 1,000 queued at 2 ms each (2 s of IPC), no more samples
    are written between two gauge updates than half an interval holds, and every sample is still
    written in the end. Counted, not timed: a pause of the process (0.1-0.3 s under `make
    test-loaded`) lengthened one gap past the 0.3 s this test once allowed, and it only shortens a
    count."""
    sys.path.insert(0, str(MODEL_PY.parent))
    try:
        from triton_outputs import MetricsWriter
    finally:
        sys.path.remove(str(MODEL_PY.parent))
    interval, ipc = 0.1, 2e-3
    metrics = SlowMetrics(ipc)
    writer = MetricsWriter(metrics, interval, lambda: {})
    try:
        for _ in range(1000):
            writer.add("itl", 0.01)
        writer.poke()
        time.sleep(1.0)
        with metrics.lock:
            updates = [(t, n) for t, n in metrics.updates if t > metrics.updates[0][0]]
        per_turn = [b[1] - a[1] for a, b in zip(updates, updates[1:])]
        gaps = [b[0] - a[0] for a, b in zip(updates, updates[1:])]
        # (256 samples a turn before: 0.5 s and more between two updates)
        assert len(updates) >= 5 and max(per_turn) <= math.ceil(0.5 * interval / ipc) + 1, per_turn  # half
        assert median(gaps) < 0.3, gaps
        assert 0 < metrics.observed < 1000                        # draining, not done
    finally:
        writer.close()
    assert metrics.observed == 1000                               # close writes the rest
