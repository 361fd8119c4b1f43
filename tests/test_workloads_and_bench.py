"""The seeded workloads (docs/design.md's mixed distribution) and `inflight bench --in-process`."""
import json

import numpy as np
import pytest

from client.tools.benchmarks import bench
from client.tools.benchmarks.workloads import FIRST_ID, make_workload, write_jsonl


def test_mixed_follows_the_design_distribution_and_is_reproducible():
    items = make_workload("mixed", 2000, seed=7)
    p = np.array([w.prompt_len for w in items])
    o = np.array([w.max_tokens for w in items])
    assert p.min() >= 8 and p.max() <= 1024 and o.min() >= 8 and o.max() <= 512
    # lognormal(4.5, 0.8): median e^4.5 ~ 90; lognormal(4.2, 0.7): median e^4.2 ~ 67
    assert abs(np.median(np.log(p)) - 4.5) < 0.08 and abs(np.std(np.log(p)) - 0.8) < 0.08
    assert abs(np.median(np.log(o)) - 4.2) < 0.08 and abs(np.std(np.log(o)) - 0.7) < 0.08
    assert all(w.ignore_eos and len(w.prompt) == w.prompt_len for w in items)
    assert min(min(w.prompt) for w in items) >= FIRST_ID
    again = make_workload("mixed", 2000, seed=7)
    assert [(w.prompt, w.max_tokens) for w in again] == [(w.prompt, w.max_tokens) for w in items]
    assert [w.prompt for w in make_workload("mixed", 5, seed=8)] != [w.prompt for w in items[:5]]


def test_arrivals_all_at_once_or_poisson():
    assert {w.arrival_s for w in make_workload("fixed", 50)} == {0.0}
    t = np.array([w.arrival_s for w in make_workload("fixed", 4000, rate=20.0)])
    gaps = np.diff(np.concatenate([[0.0], t]))
    assert np.all(gaps >= 0) and abs(gaps.mean() - 1 / 20) < 0.005
    assert abs(gaps.std() / gaps.mean() - 1.0) < 0.1  # exponential: coefficient of variation 1


def test_jsonl_round_trip_and_text_prompts(tmp_path, default_model_dir):
    from backend.text.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(default_model_dir)
    items = make_workload("mixed", 6, seed=1, prompt_format="text", tokenizer=tok)
    assert all(isinstance(w.prompt, str) and w.prompt for w in items)
    assert all(abs(w.prompt_len - len(tok.encode(w.prompt))) == 0 for w in items)
    path = tmp_path / "w.jsonl"
    write_jsonl(items, path)
    back = make_workload(str(path), 8)
    assert [w.prompt for w in back[:6]] == [w.prompt for w in items] and back[6].prompt == items[0].prompt
    with pytest.raises(ValueError, match="fixed, mixed, hol, extractive, images, embeddings or a .jsonl"):
        make_workload("nope", 3)


@pytest.mark.slow
def test_bench_in_process_every_mode(default_model_dir, tmp_path, capsys):
    out = tmp_path / "b.json"
    rc = bench.main(["--in-process", "--model-path", str(default_model_dir), "--mode", "inflight,static,none",
                     "--workload", "fixed", "--fixed-prompt-len", "12", "--fixed-output-len", "4",
                     "--num-requests", "6", "--concurrency", "1,3", "--warmup", "1", "--no-progress",
                     "--param", "max_queue_delay_microseconds=1000", "--output-json", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    assert [(r["mode"], r["concurrency"]) for r in data["results"]] == [  # modes take turns
        ("inflight", 1), ("static", 1), ("none", 1), ("inflight", 3), ("static", 3), ("none", 3)]
    for r in data["results"]:
        assert r["completed"] == 6 and r["failed"] == 0 and r["output_tokens"] == 24
        for key in bench.METRIC_KEYS:
            assert key in r
        assert r["kv_usage_peak"] is not None and r["preemptions"] == 0
        if r["mode"] == "static":  # answered once per request, at the end of its batch
            assert r["itl_p50_s"] is None and r["ttft_p50_s"] == pytest.approx(r["e2e_p50_s"])
    assert {x["kind"] for x in data["ratios"]} == {"inflight/static", "inflight/none"}
    assert data["meta"]["workload_summary"]["total_output_tokens"] == 24
    assert out.with_suffix(".csv").exists() and out.with_suffix(".png").exists()
    assert "inflight/none" in capsys.readouterr().out


def test_ratios_use_the_means_and_show_each_repeat():
    row = lambda target, mode, tps: {"target": target, "mode": mode, "concurrency": 64, "output_tokens_per_s": tps}
    results = [row("in-process", "inflight", 3000.0), row("in-process", "none", 300.0),
               row("in-process", "none", 250.0), row("in-process", "inflight", 2000.0),
               row("server-grpc", "inflight", 1250.0)]
    (vs_none, vs_server) = bench.ratios(results)
    assert vs_none["kind"] == "inflight/none"
    assert vs_none["ratio"] == pytest.approx(2500.0 / 275.0)
    assert vs_none["per_repeat"] == pytest.approx([10.0, 8.0])
    assert vs_server["kind"] == "server-grpc/in-process" and vs_server["ratio"] == pytest.approx(0.5)
    assert vs_server["per_repeat"] == []  # one server run against two in-process ones: no pairs


def test_bench_refuses_bad_arguments(capsys):
    assert bench.main(["--in-process"]) == 2
    with pytest.raises(SystemExit):
        bench.main(["--in-process", "--model-path", ".", "--mode", "continuous"])


def test_bench_offline_runs_generate_per_mode(default_model_dir, tmp_path):
    out = tmp_path / "o.json"
    rc = bench.main(["--offline", "--model-path", str(default_model_dir), "--mode", "inflight,none",
                     "--workload", "fixed", "--fixed-prompt-len", "10", "--fixed-output-len", "3",
                     "--num-requests", "5", "--warmup", "1", "--no-progress", "--output-json", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    assert [(r["target"], r["mode"], r["concurrency"]) for r in data["results"]] == [
        ("offline", "inflight", 5), ("offline", "none", 5)]
    assert all(r["output_tokens"] == 15 and r["failed"] == 0 for r in data["results"])
    assert [x["kind"] for x in data["ratios"]] == ["inflight/none"]
