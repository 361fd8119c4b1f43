"""The pacing benchmark's baseline (client/tools/benchmarks/pacing.py): the streams' gaps without the
arrivals are compared at the same stream and token index as the gaps while prompts arrive, since a
decode step grows with its rows' context."""
import json

import pytest

from client.tools.benchmarks import pacing

from client.tools.benchmarks.pacing import Tracker, matched


def _tracker(times: dict[str, list[float]]) -> Tracker:
    t = Tracker()
    t.times = {rid: list(v) for rid, v in times.items()}
    return t


def test_indexed_gaps_are_keyed_by_stream_and_the_token_that_ends_them():
    t = _tracker({"a": [0.0, 1.0, 3.0, 6.0], "b": [0.5, 0.7, 2.0]})
    gaps = t.indexed_gaps(["a", "b"], 2.0, 6.0)
    assert set(gaps) == {(0, 2), (0, 3), (1, 2)} and gaps[(0, 2)] == 2.0 and gaps[(0, 3)] == 3.0
    assert abs(gaps[(1, 2)] - 1.3) < 1e-12
    assert sorted(t.gaps(["a", "b"], 2.0, 6.0)) == sorted(gaps.values())


def test_the_matched_baseline_takes_the_quiet_gaps_at_the_mixed_gaps_keys_only():
    # Quiet: gaps grow with the token index (context); mixed: gaps only at late indices.
    quiet = {(s, k): k / 100 for s in range(2) for k in range(1, 101)}
    during = {(0, 90): 0.5, (1, 95): 0.6, (1, 200): 0.7}  # (1, 200): no quiet gap there: left out
    assert sorted(matched(quiet, during)) == [0.9, 0.95]
    # Overlapping arrival windows give the same gap once: keys, not a list.
    t = _tracker({"a": [0.0, 1.0, 2.0, 3.0]})
    both = {}
    for since, until in ((0.5, 2.5), (1.5, 3.5)):
        both.update(t.indexed_gaps(["a"], since, until))
    assert sorted(both) == [(0, 1), (0, 2), (0, 3)]


def test_paced_params_become_typed_overrides_and_a_wrong_key_is_refused():
    from client.tools.benchmarks.pacing import paced_overrides
    assert paced_overrides(["inter_token_auto_factor=2.5", "max_num_seqs=12"]) == {
        "inter_token_auto_factor": 2.5, "max_num_seqs": 12}
    with pytest.raises(SystemExit, match="inter_token_auto_fctor"):
        paced_overrides(["inter_token_auto_fctor=2"])


def test_the_trace_records_caps_and_paced_steps_with_their_prediction_then_unwraps(tmp_path):
    from backend.sched.pacing import Pacer
    from backend.sched.step_cost import step_features

    path = tmp_path / "trace.jsonl"
    original = Pacer.prefill_cap, Pacer.observe
    pacer = Pacer(-1.0, 1.75)
    for _ in range(20):   # a device: 2 ms a step, 1 ms a decode row, 10 us a prompt token
        pacer.observe(4, 0, 0.0, 6e-3)
        pacer.observe(0, 512, 0.0, 2e-3 + 512e-5)
    with pacing.PacerTrace(str(path)) as trace:
        trace.turn = "0.0.paced"
        cap = pacer.prefill_cap(4, 100, 400.0)
        predicted = pacer.cost.predict(step_features(4, cap, 0.0, 400.0))
        pacer.observe(4, cap, 0.0, 0.02, 400.0)
        pacer.observe(4, 0, 0.0, 6e-3, 400.0)   # a decode-only step: not a paced one, not written
    assert (Pacer.prefill_cap, Pacer.observe) == original
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["kind"] for r in rows] == ["cap", "step"] and {r["turn"] for r in rows} == {"0.0.paced"}
    assert rows[0]["cap"] == cap and rows[0]["target_s"] == pytest.approx(pacer.target_seconds(4, 400.0), rel=0.2)
    assert rows[1]["tokens"] == cap and rows[1]["seconds"] == 0.02 and rows[1]["predicted_s"] == pytest.approx(predicted)
