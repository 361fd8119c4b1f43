"""The seed-claims tool (client/tools/benchmarks/seed_claims.py, seed_report.py): its percentiles,
its goodput search per batching mode and the instances arithmetic against hand-computed cases (a
synthetic target, no engine), the verdicts on hand-made rows, and one tiny end-to-end run per claim
on the embedded default model."""
import argparse
import json
import math
import time

import pytest

from client.tools.benchmarks import seed_claims
from client.tools.benchmarks.seed_report import verdict_goodput, verdict_long_prompts, verdict_max_seqs


def test_window_percentiles_are_numpy_linear_on_hand_computed_cases():
    gaps = [i / 1000 for i in range(1, 101)]  # 1..100 ms
    s = seed_claims.window_stats(gaps)
    assert s["itl_p50_s"] == pytest.approx(0.0505)   # halfway between the 50th and 51st
    assert s["itl_p99_s"] == pytest.approx(0.09901)  # rank 98.01: 99 ms + 0.01 x 1 ms
    assert s["itl_max_s"] == 0.1 and s["gaps"] == 100
    assert seed_claims.window_stats([])["itl_p99_s"] is None


class FakeTarget:
    """A server of `capacity` requests/s: TTFT p99 0.5 s at or below it, 5 s above; static answers
    once (no inter-token gaps)."""
    CAPACITY = {"inflight": 3.0, "static": 1.0, "none": 0.3}

    def __init__(self, mode, params, log):
        self.mode, self.params, self.log = mode, params, log

    def run(self, items, concurrency, progress=False, timeout=None):
        rate = len(items) / max(w.arrival_s for w in items) if any(w.arrival_s for w in items) else None
        self.log.append((self.mode, rate, len(items), timeout))
        ok = rate is None or rate <= self.CAPACITY[self.mode] * 1.0001
        return {"num_requests": len(items), "completed": len(items), "failed": 0, "ttft_p99_s": 0.5 if ok else 5.0,
                "itl_p99_s": None if self.mode == "static" else 0.05, "ttft_p50_s": 0.1, "itl_p50_s": 0.01,
                "kv_usage_peak": 0.5, "waiting_mean": 0.0, "output_tokens_per_s": 10.0}

    def close(self):
        pass


def goodput_args(**kw):
    base = dict(modes=["none", "static", "inflight"], batch=64, extra={}, workload="fixed", seed=0, vocab=2000,
                max_output_len=8, slo_ttft_p99=2.0, slo_itl_p99=0.2, rate=1.0, max_runs=6, tolerance=0.25,
                min_rate=0.05, duration=400.0, min_requests=12, drain_s=7.0, target_rpm=2000.0)
    return argparse.Namespace(**{**base, **kw})


@pytest.fixture
def exact_arrivals(monkeypatch):
    """make_workload's Poisson arrivals, made exact (i / rate) so that the synthetic server sees the rate asked."""
    from client.tools.benchmarks import workloads
    real = workloads.make_workload

    def make(name, n, **kw):
        items = real(name, n, **kw)
        if kw.get("rate"):
            for i, w in enumerate(items):
                w.arrival_s = (i + 1) / kw["rate"]
        return items
    monkeypatch.setattr(workloads, "make_workload", make)


def test_goodput_per_mode_and_the_instances_for_2000_a_minute(exact_arrivals):
    log = []
    rows = seed_claims.run_goodput(goodput_args(), lambda mode, params: FakeTarget(mode, params, log))
    by = {r["mode"]: r for r in rows}
    # inflight (capacity 3): 1 met, 2 met, 4 missed, 3 met, 3.5 missed; 3.5 - 3 <= 0.25 x 3: stop
    assert [r["rate"] for r in by["inflight"]["runs"]] == [1, 2, 4, 3, 3.5]
    assert by["inflight"]["goodput_rps"] == 3 and by["inflight"]["instances"] == 12  # ceil(33.3 / 3)
    # none (capacity 0.3): 1, 0.5 missed, 0.25 met, 0.375 missed, 0.3125 missed; 0.0625 <= 0.0625: stop
    assert [r["rate"] for r in by["none"]["runs"]] == [1, 0.5, 0.25, 0.375, 0.3125]
    assert by["none"]["goodput_rps"] == 0.25 and by["none"]["instances"] == 134  # ceil(33.3 / 0.25)
    # static answers once: no gaps, which meet the ITL bound; only its TTFT binds it
    assert by["static"]["goodput_rps"] == 1.0 and by["static"]["instances"] == 34
    assert all(r["itl_p99_s"] == 0.0 for r in by["static"]["runs"])
    assert all(t == 7.0 for _, rate, _, t in log if rate)  # every timed run bounded by --drain-s
    word, why = verdict_goodput(rows)
    assert word == "refuted" and "12 instances" in why and "(static) 34" in why and "2.8x" in why
    rows[0]["instances"] = 48  # none: 48 against 12 is the seed's 4x
    assert verdict_goodput([r for r in rows if r["mode"] != "static"])[0] == "reproduced"
    by["inflight"]["lowest_missed_rps"] = None  # no rate missed: 3/s is a lower bound, 12 instances an upper one
    word, why = verdict_goodput([r for r in rows if r["mode"] != "static"])
    assert word == "undecided" and "inflight met the SLO at every rate tried" in why


def test_only_a_mode_that_answers_once_gets_its_missing_gaps_as_met():
    r = {"completed": 3, "itl_p99_s": None}
    assert seed_claims.slo_result("dynamic", r)["itl_p99_s"] == 0.0
    assert seed_claims.slo_result("inflight", r)["itl_p99_s"] is None  # a streaming mode without gaps misses
    assert seed_claims.slo_result("static", {"completed": 0, "itl_p99_s": None})["itl_p99_s"] is None


def test_max_seqs_runs_the_same_workload_per_max_num_seqs_with_the_kv_cache_fixed():
    log, made = [], []

    def make(mode, params):
        made.append(params)
        return FakeTarget(mode, params, log)
    args = argparse.Namespace(workload="fixed", num_requests=10, seed=0, rate=5.0, vocab=2000, max_output_len=8,
                              max_seqs=[8, 64], kv_tokens=1000, drain_s=3.0, extra={})
    rows = seed_claims.run_max_seqs(args, make)
    assert [p["max_num_seqs"] for p in made] == [8, 64] and all(p["max_tokens_in_paged_kv_cache"] == 1000 for p in made)
    assert [r["max_num_seqs"] for r in rows] == [8, 64]
    assert [n for _, _, n, _ in log] == [2, 10, 2, 10]  # warm-up (2 untimed), then the run


def row(n, ttft, itl, kv, pre=0):
    return {"max_num_seqs": n, "ttft_p99_s": ttft, "itl_p99_s": itl, "kv_usage_peak": kv, "preemptions": pre}


def test_max_seqs_verdict_needs_a_rise_past_the_best_with_the_kv_cache_full():
    rising = [row(8, 2.0, 0.1, 0.3), row(16, 1.0, 0.1, 0.5), row(32, 1.2, 0.12, 0.95), row(64, 3.0, 0.2, 1.0)]
    word, why = verdict_max_seqs(rising)
    assert word == "reproduced" and "from max_num_seqs 16 to 64" in why  # 32 is within 1.25x of 16's
    assert verdict_max_seqs([row(8, 2.0, 0.1, 0.3), row(16, 1.0, 0.1, 0.5), row(64, 3.0, 0.1, 0.6)])[0] == "refuted"
    assert verdict_max_seqs([row(8, 2.0, 0.1, 0.3), row(16, 1.0, 0.1, 0.5), row(64, 1.0, 0.2, 0.6, pre=3)])[0] \
        == "reproduced"  # the ITL p99 doubled with preemptions
    word, why = verdict_max_seqs([row(8, 2.0, 0.1, 1.0), row(16, 1.0, 0.1, 1.0), row(64, 1.2, 0.12, 1.0)])
    assert word == "refuted" and "no max_num_seqs above 16" in why
    word, why = verdict_max_seqs([row(8, 2.0, 0.1, 1.0), row(16, 1.0, 0.1, 1.0)])
    assert word == "refuted" and "the largest max_num_seqs (16) had the lowest TTFT p99" in why


def test_long_prompts_verdict_compares_unchunked_with_the_best_chunked_at_every_length():
    def lp(config, n, p99):
        return {"config": config, "prompt_tokens": n, "itl_p99_s": p99}
    rows = [lp("unchunked", 2048, 2.0), lp("chunk 128", 2048, 0.5), lp("paced (default)", 2048, 0.9),
            lp("unchunked", 4096, 4.0), lp("chunk 128", 4096, 1.5)]
    word, why = verdict_long_prompts(rows)
    assert word == "reproduced" and "chunk 128 500 ms (4.0x)" in why and "(2.7x)" in why
    rows[-1]["itl_p99_s"] = 2.5  # 4,096: unchunked only 1.6x the best chunked
    assert verdict_long_prompts(rows)[0] == "refuted"
    rows[3]["itl_p99_s"] = 0.5  # unchunked below every chunked config: compared with the best chunked, not itself
    word, why = verdict_long_prompts(rows)
    assert word == "refuted" and "4,096 tokens: unchunked 500 ms vs chunk 128 2,500 ms (0.2x)" in why


def test_chunk_configs_are_unchunked_then_each_chunk_unpaced_then_the_default():
    c = seed_claims.chunk_configs([128, 512], 8192)
    assert list(c) == ["unchunked", "chunk 128", "chunk 512", "paced (default)"]
    assert c["unchunked"] == {"enable_chunked_context": False, "inter_token_target_ms": 0.0, "max_num_batched_tokens": 8192}
    assert c["chunk 512"] == {"max_num_batched_tokens": 512, "inter_token_target_ms": 0.0} and c["paced (default)"] == {}


@pytest.mark.slow  # an engine per config: ~4 s of CPU each, 5-20 s on a loaded machine
@pytest.mark.parametrize("claim, sizes", [
    ("max-seqs", ["--max-seqs", "2,4", "--num-requests", "5", "--rate", "20", "--max-output-len", "5"]),
    ("long-prompts", ["--lengths", "70", "--chunks", "16", "--streams", "2", "--quiet-s", "0.2", "--max-model-len", "256"]),
    ("goodput", ["--modes", "static,inflight", "--duration", "0.5", "--min-requests", "3", "--max-runs", "1",
                 "--max-output-len", "5", "--rate", "2"]),
])
def test_each_claim_runs_end_to_end_on_the_tiny_model(claim, sizes, default_model_dir, tmp_path, capsys):
    assert seed_claims.main([claim, "--model-path", str(default_model_dir), "--out-dir", str(tmp_path), *sizes]) == 0
    stem = "seed_" + claim.replace("-", "_")
    data = json.loads((tmp_path / "bench" / f"{stem}.json").read_text())
    assert data["rows"] and (tmp_path / f"{stem}.png").stat().st_size > 1000
    md = (tmp_path / "bench" / f"{stem}.md").read_text()
    assert md in capsys.readouterr().out and any(f"**{w}**" in md for w in ("reproduced", "refuted", "undecided"))
    if claim == "max-seqs":
        assert [r["max_num_seqs"] for r in data["rows"]] == [2, 4] and all(r["failed"] == 0 for r in data["rows"])
        assert all(r["waiting_peak"] is not None for r in data["rows"])
    elif claim == "long-prompts":
        assert [r["config"] for r in data["rows"]] == ["unchunked", "chunk 16", "paced (default)"]
        assert all(r["gaps"] > 0 and not r["cut"] for r in data["rows"])
    else:
        assert [r["mode"] for r in data["rows"]] == ["static", "inflight"]
        assert all(math.isfinite(r["runs"][0]["ttft_p99_s"]) for r in data["rows"])


def test_a_bounded_run_aborts_what_is_unanswered_and_the_engine_goes_back_to_idle(default_model_dir):
    from client.tools.benchmarks.targets import InProcessTarget
    from client.tools.benchmarks.workloads import WorkItem

    target = InProcessTarget(str(default_model_dir), "inflight", {"max_model_len": "512"})
    try:
        items = [WorkItem(0, list(range(3, 40)), 37, 4), WorkItem(1, list(range(50, 93)), 43, 460)]
        r = target.run(items, 2, timeout=0.3)  # the short answer finishes, the long one is cut
        assert (r["completed"], r["failed"]) == (1, 1) and "finish_reason=abort" in r["errors"]
        for _ in range(200):  # the stats are the last step's: wait for the step after the abort
            s = target.engine.stats()
            if not s["num_requests_running"]:
                break
            time.sleep(0.01)
        assert s["num_requests_running"] == 0 and s["num_requests_waiting"] == 0 and s["kv_cache_usage_ratio"] == 0
    finally:
        target.close()
