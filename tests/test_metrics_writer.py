"""model_repository/llm/1/triton_outputs.py's MetricsWriter, on a fake metrics object whose every
observation is a slow IPC: the gauges stay fresh while a backlog of histogram samples drains."""
import sys
import threading
import time

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
            self.updates.append(time.monotonic())


def test_the_gauges_stay_fresh_while_a_backlog_of_samples_drains(frozen_heap):
    """Under load a metric IPC took long enough that 256 samples between two gauge updates held one
    instance's running gauge at 0 for the whole of a test's requests. The samples now get half the
    interval, whatever an IPC costs: with 1,000 queued at 2 ms each (2 s of IPC), the gauges are
    updated at least every ~interval, and every sample is still written in the end."""
    sys.path.insert(0, str(MODEL_PY.parent))
    try:
        from triton_outputs import MetricsWriter
    finally:
        sys.path.remove(str(MODEL_PY.parent))
    metrics = SlowMetrics(ipc=2e-3)
    writer = MetricsWriter(metrics, 0.1, lambda: {})
    try:
        for _ in range(1000):
            writer.add("itl", 0.01)
        writer.poke()
        time.sleep(1.0)
        with metrics.lock:
            updates = [t for t in metrics.updates if t > metrics.updates[0]]
        gaps = [b - a for a, b in zip(updates, updates[1:])]
        assert len(updates) >= 5 and max(gaps) < 0.3, gaps      # (256 samples a turn: 0.5 s and more between)
        assert 0 < metrics.observed < 1000                        # draining, not done
    finally:
        writer.close()
    assert metrics.observed == 1000                               # close writes the rest
