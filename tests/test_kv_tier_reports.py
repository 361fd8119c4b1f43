"""What the KV tiers report: the per-request cached tokens (engine output, the Triton output
`num_cached_tokens`, the OpenAI API's `usage.prompt_tokens_details.cached_tokens`) and the
`inflight_kv_tier_*` metrics that model.py writes from the engine's stats."""
import importlib.util
import sys

import numpy as np
import pytest

from backend import LLM, SamplingParams
from openai_server.responses import ChoiceState, pieces, usage
from test_gpu_rehearsal import MODEL_PY, _MetricFamily, fake_pb_utils

TIER_STATS = {"device": {"hits": 7, "misses": 5},
              "host": {"hits": 3, "misses": 2, "bytes_loaded": 300, "bytes_stored": 500, "dropped": 1,
                       "blocks_used": 4, "blocks_total": 8},
              "disk": {"hits": 2, "misses": 0, "bytes_loaded": 200, "bytes_stored": 900, "rejected": 1,
                       "write_failures": 0, "blocks_used": 9, "blocks_total": 64}}


@pytest.mark.slow
def test_cached_prompt_tokens_reach_the_output_and_the_triton_tensor(default_model_dir):
    llm = LLM(str(default_model_dir), kv_block_size=16, max_tokens_in_paged_kv_cache=512)
    prompt = list(range(3, 40))  # 2 full blocks and 5 tokens
    params = SamplingParams(max_tokens=2, temperature=0)
    first, again = llm.generate([prompt], params)[0], llm.generate([prompt + [9]], params)[0]
    assert (first.num_cached_tokens, again.num_cached_tokens) == (0, 32)

    sys.path.insert(0, str(MODEL_PY.parent))
    try:
        from live_request import Live
        from triton_outputs import output_tensors
    finally:
        sys.path.remove(str(MODEL_PY.parent))
    # the door's own record of a request in flight (a stand-in went stale when Live grew a field)
    live = Live("offline-1", "", None, stream=True, exclude_input=True, prompt_text=None, arrival=0.0,
                latest={0: again}, returns=frozenset({"return_num_cached_tokens"}))
    tensors = output_tensors(live, {0: again}, lambda ids: "")
    assert tensors["num_cached_tokens"].dtype == np.uint32 and list(tensors["num_cached_tokens"]) == [32]
    live.returns = frozenset()
    assert "num_cached_tokens" not in output_tensors(live, {0: again}, lambda ids: "")  # only when asked


def test_openai_usage_shows_cached_tokens_when_the_model_reports_them():
    def getter(**arrays):
        return lambda name: np.array(arrays[name]) if name in arrays else None

    state = ChoiceState()
    for piece in pieces(getter(text_output=[b"Hi"], finish_reason=[b"stop"], num_output_tokens=[1],
                               num_input_tokens=[40], num_cached_tokens=[32]), None):
        state.add(piece)
    assert usage([state], 1) == {"prompt_tokens": 40, "completion_tokens": 1, "total_tokens": 41,
                                 "prompt_tokens_details": {"cached_tokens": 32}}
    older = ChoiceState(num_input_tokens=40, num_output_tokens=1)  # a model without the output
    assert "prompt_tokens_details" not in usage([older], 1)


def _model_metrics(monkeypatch, module_name: str):
    """model.py loaded under a fake Triton (none of its metric families made yet) and the Metrics
    it gives an instance llm_0_0 on the CPU."""
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", fake_pb_utils())
    _MetricFamily.created = []
    spec = importlib.util.spec_from_file_location(module_name, MODEL_PY)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    labels = {"model": "llm", "version": "1", "instance": "llm_0_0", "device": "cpu"}
    return module.Metrics(labels, module.pb_utils.MetricFamily)


def test_tier_metrics_follow_the_engine_stats(monkeypatch):
    metrics = _model_metrics(monkeypatch, "inflight_tier_metrics_model")
    base = {"num_requests_running": 0, "num_requests_waiting": 0, "kv_blocks_total": 8, "kv_blocks_used": 0}
    metrics.update({**base, "kv_tiers": TIER_STATS})
    later = {t: dict(f) for t, f in TIER_STATS.items()}
    later["host"].update(hits=10, bytes_loaded=1000, blocks_used=6)
    metrics.update({**base, "kv_tiers": later})

    def value(name, **want):
        (family,) = [f for f in _MetricFamily.created if f.name == name]
        (metric,) = [m for m in family.metrics if all(m.labels.get(k) == v for k, v in want.items())]
        assert metric.labels["instance"] == "llm_0_0"
        return metric.value

    assert value("inflight_kv_tier_hits_total", tier="host") == 10  # counters rise by the engine's deltas
    assert value("inflight_kv_tier_hits_total", tier="device") == 7
    assert value("inflight_kv_tier_misses_total", tier="disk") == 0
    assert value("inflight_kv_tier_bytes_total", tier="host", direction="load") == 1000
    assert value("inflight_kv_tier_bytes_total", tier="disk", direction="store") == 900
    assert value("inflight_kv_tier_failures_total", tier="disk", kind="rejected") == 1
    assert value("inflight_kv_tier_failures_total", tier="host", kind="dropped") == 1
    assert value("inflight_kv_tier_blocks", tier="host", state="used") == 6
    assert value("inflight_kv_tier_blocks", tier="disk", state="total") == 64


def test_an_update_counts_the_tokens_before_it_shows_the_requests_gone(monkeypatch):
    """A scrape in the middle of an update must not see no request running beside counters that
    miss the last tokens (a clean-clone run read 3,839 of 3,840 generated tokens that way): the
    counters move before the gauges."""
    metrics = _model_metrics(monkeypatch, "inflight_update_order_model")
    base = {"num_requests_waiting": 0, "kv_blocks_total": 8, "kv_blocks_used": 0}
    metrics.update({**base, "num_requests_running": 1, "generation_tokens_total": 479})
    order = []
    for family in _MetricFamily.created:
        for metric in family.metrics:
            for name in ("set", "increment"):
                def spy(value, _metric=metric, _name=name, _original=getattr(metric, name)):
                    order.append((_metric.family.name, _name))
                    _original(value)
                setattr(metric, name, spy)
    metrics.update({**base, "num_requests_running": 0, "generation_tokens_total": 480})
    moves = [n for n, _ in order]
    assert "inflight_generation_tokens_total" in moves and "inflight_num_requests_running" in moves
    assert moves.index("inflight_generation_tokens_total") < moves.index("inflight_num_requests_running")


def test_the_tier_series_exist_with_their_values_before_the_model_is_ready(monkeypatch):
    """The metrics writer makes its first report when model.py's initialize builds it, not on its
    thread later: a served test that waited for the host tier's fill series read the disk tier's
    before it was made (a KeyError; the series are made one IPC at a time) or before it was set."""
    metrics = _model_metrics(monkeypatch, "inflight_first_report_model")
    sys.path.insert(0, str(MODEL_PY.parent))
    try:
        from triton_outputs import MetricsWriter
    finally:
        sys.path.remove(str(MODEL_PY.parent))
    base = {"num_requests_running": 0, "num_requests_waiting": 0, "kv_blocks_total": 8, "kv_blocks_used": 0}
    writer = MetricsWriter(metrics, 3600.0, lambda: {**base, "kv_tiers": TIER_STATS})  # its thread waits an hour
    try:
        series = {(f.name, m.labels.get("tier"), m.labels.get("state")): m.value
                  for f in _MetricFamily.created for m in f.metrics}
        assert series.get(("inflight_kv_tier_blocks", "disk", "used")) == 9
        assert series.get(("inflight_kv_tier_blocks", "host", "total")) == 8
        assert series.get(("inflight_kv_tier_hits_total", "disk", None)) == 2
    finally:
        writer.close()
