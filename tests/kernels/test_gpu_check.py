"""`inflight gpu-check`: its real run needs a GPU, so the whole of it is rehearsed on the CPU
(--dry-run: tiny shapes, the Triton interpreter, the compile part with the real compiler for sm_90,
a real local tritonserver with two instances), including the device check, which must fail there:
the instances serve from the CPU. Its greedy check is shown to fail when the engine and
transformers disagree, its verdict to refuse a dry run whose device check passed, a part that
overruns its budget to be cut with its partial results kept, and SIGTERM to print the table."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from client.tools.gpu_check import run as gpu_check

from client.tools.gpu_check import plan as gpu_check_plan
from client.tools.gpu_check.plan import DRY
from client.tools.gpu_check.sampling import KNOB_CASES
from client.tools.gpu_check.report import verdict
from client.tools.gpu_check.served import device_check, kv_check, scrape, tokens_by_instance

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-check")
    proc = subprocess.run([sys.executable, "-m", "client.cli", "gpu-check", "--dry-run", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=1200)
    report = (out / "gpu_check.md").read_text() if (out / "gpu_check.md").exists() else ""
    return proc, report, out


def results(report: str) -> dict:
    return json.loads(report.split("```json\n", 1)[1].rsplit("\n```", 1)[0])


@pytest.mark.slow
def test_dry_run_passes_on_the_cpu_with_every_part(dry_run):
    proc, report, out = dry_run
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    res = results(report)
    assert res["ok"] and res["dry_run"] and res["problems"] == []
    parts = res["parts"]
    for name in gpu_check_plan.PART_NAMES:    # each part's JSON and log, written as it ended
        assert json.loads((out / f"{name}.json").read_text())["budget"] == gpu_check_plan.DRY_BUDGET_S
        assert (out / f"{name}.log").exists() or parts[name].get("skipped")
    compiled = parts["compile"]
    assert compiled["target"] == "sm_90" and compiled["compiled"] == compiled["variants"] > 10
    assert compiled["variants"] == DRY["compile_max_variants"] < compiled["planned"]   # (each kernel first)
    assert compiled["failed"] == [] and compiled["cached"] == 0          # a cache of its own: all compiled
    kernels = parts["kernels"]   # kernel_bench's whole CPU rehearsal (--dry-run-cpu), through its command line
    assert {c["kernel"] for c in kernels["checks"]} == {
        "decode_attention", "prefill_attention", "store_kv", "rms_norm", "rotary_embedding", "silu_mul", "fused_moe"}
    assert kernels["failed_checks"] == 0 and all(c["ok"] for c in kernels["checks"])
    assert kernels["quant_checks"] and all(c["ok"] for c in kernels["quant_checks"]) and kernels["quant_linear"]
    assert any(r["kernel"] == "fused_moe" for r in kernels["kernels"]) and kernels["copy_bandwidth_gbs"] > 0
    assert len(kernels["decode_attention"]) == 2 and kernels["decode_tuning"]
    assert [(r["batch"], r["context"]) for r in kernels["engine_decode_step"]] == [(1, 20), (2, 20)]
    assert kernels["partial"] is False
    greedy = parts["greedy"]
    assert [b["batch"] for b in greedy["batches"]] == [b for b, _, _ in DRY["greedy_batches"]]
    assert all(b["ok"] and b["tokens"] == b["batch"] * DRY["max_tokens"] for b in greedy["batches"])
    assert greedy["engine"]["kernels"] == "triton" and greedy["engine"]["dtype"] == "float32"
    assert all(b["float32"]["positions"] == b["tokens"] and b["float32"]["over"] == 0 for b in greedy["batches"])
    assert greedy["vision"]["ok"] and greedy["pooling"]["ok"]  # issue 44: images and embeddings on the device
    decode = parts["decode"]["rows"]
    assert {(r["batch"], r["context"], r["graphs"]) for r in decode} == {
        (b, c, g) for b, c in DRY["decode_shapes"] for g in (True, False)}
    assert all(r["engine_ms"] > 0 and r["microbench_ms"] > 0 and r["floor_ms"] > 0 for r in decode)
    assert {r["weights"] for r in decode} == {"none"} and parts["decode"]["fp8"] == "skipped: the engine is on the CPU"
    graphs = parts["decode"]["graph_vs_eager"]
    assert graphs["ok"] and graphs["requests"] == sum(DRY["graph_check"]["batches"])
    assert parts["structured"]["json"]["ok"] and parts["structured"]["choice"]["ok"]
    knobs = parts["structured"]["knobs"]  # issue 43's sampling knobs: the sampler and the engine
    assert knobs["ok"] and knobs["exact"] == len(KNOB_CASES) * 200 and parts["structured"]["knobs_engine"]["ok"]
    assert set(parts["structured"]["knobs_engine"]["checks"]) == {
        "logit_bias", "allowed_token_ids", "truncate_prompt_tokens", "with_structured_outputs", "prompt_logprobs"}
    served = parts["served"]
    assert served["kv"]["ok"] and served["requests"]["ok"] and served["throughput"]["ok"]
    for part in ("| kernels | PASS |", "| greedy | PASS |", "Greedy, teacher-forced", "Engine decode step",
                 "Served / in-process", "| served | PASS (its device check failed"):
        assert part in report, part
    assert "GPU budget" in proc.stdout and "| part | result | seconds | budget | figures |" in proc.stdout


@pytest.mark.slow
def test_the_dry_run_device_check_fails_the_cpu_served_instances(dry_run):
    """Both instances serve from the CPU: the check that reads their device label must say so."""
    _, report, _ = dry_run
    devices = results(report)["parts"]["served"]["devices"]
    assert not devices["ok"] and devices["devices"] == {"llm_0_0": "cpu", "llm_0_1": "cpu"}
    assert "not on a GPU" in devices["reason"]


SERIES = """# HELP inflight_kv_blocks KV-cache blocks by state
inflight_kv_blocks{{device="{a}",instance="llm_0_0",model="llm",state="total",version="1"}} 900
inflight_kv_blocks{{device="{b}",instance="llm_0_1",model="llm",state="total",version="1"}} 90
inflight_kv_blocks{{device="{b}",instance="llm_0_1",model="llm",state="used",version="1"}} 0
"""


def test_device_check_reads_the_label_of_every_instance():
    assert device_check(scrape(SERIES.format(a="cuda:0", b="cuda:0")), 2)["ok"]
    one_on_cpu = device_check(scrape(SERIES.format(a="cuda:0", b="cpu")), 2)
    assert not one_on_cpu["ok"] and one_on_cpu["reason"] == "instances not on a GPU: {'llm_0_1': 'cpu'}"
    assert not device_check(scrape(SERIES.format(a="cuda:0", b="cuda:0")), 3)["ok"]    # one missing


def test_kv_check_wants_the_second_engine_sized_after_the_first():
    series = scrape(SERIES.format(a="cuda:0", b="cuda:0"))
    assert kv_check(series, 2**20, 2**40)["ok"]
    assert not kv_check(series, 2**30, 2**39)["ok"]                       # 990 GiB would not fit
    same = scrape(SERIES.format(a="cuda:0", b="cuda:0").replace(" 90\n", " 900\n"))
    assert not kv_check(same, 2**20, 2**40)["ok"] and kv_check(same, 2**20, 0)["ok"]   # equal: GPU only


def test_generated_tokens_are_summed_per_instance():
    page = ('inflight_generation_tokens_total{device="cpu",instance="llm_0_0",model="llm",version="1"} 40\n'
            'inflight_generation_tokens_total{device="cpu",instance="llm_0_1",model="llm",version="1"} 24\n'
            'inflight_prompt_tokens_total{device="cpu",instance="llm_0_1",model="llm",version="1"} 99\n')
    assert tokens_by_instance(scrape(page)) == {"llm_0_0": 40.0, "llm_0_1": 24.0}


def test_a_dry_run_whose_device_check_passed_is_refused():
    parts = {"served": {"devices": {"ok": True}, "kv": {"ok": True}}}
    ok, problems = verdict(parts, dry_run=True)
    assert not ok and "cannot tell a CPU-served instance" in problems[0]
    assert verdict(parts, dry_run=False) == (True, [])
    assert verdict({"served": {"devices": {"ok": False}}}, dry_run=True) == (True, [])
    assert not verdict({"served": {"ok": False, "error": "crashed"}}, dry_run=True)[0]
    # skipped parts pass; a cut part fails even if what it got through passed
    assert verdict({"served": {"ok": True, "skipped": "needs tritonclient"}}, dry_run=True) == (True, [])
    assert not verdict({"kernels": {"ok": False, "cut": True, "error": "stopped"}}, dry_run=False)[0]
    assert not verdict({"decode": {"ok": False, "graph_vs_eager": {"ok": True}}}, dry_run=False)[0]


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory):
    from backend.models.make_model import make_model

    root = tmp_path_factory.mktemp("gpu-check-models")
    return [make_model(root / f"seed{seed}", seed=seed, **DRY["model"]) for seed in (3, 4)]


@pytest.mark.slow
def test_greedy_check_fails_when_the_engine_and_transformers_disagree(two_checkpoints, monkeypatch):
    """transformers is handed other weights than the engine ran: the check must notice."""
    from transformers import AutoModelForCausalLM

    from client.tools.gpu_check.greedy import greedy

    load = AutoModelForCausalLM.from_pretrained.__func__
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained",
                        classmethod(lambda cls, path, **kw: load(cls, str(two_checkpoints[1]), **kw)))
    # the text batch only: the images and pooling cases load their own checkpoints, not these
    plan = dict(DRY, greedy_batches=[(2, 5, 12)], greedy_cases=())
    res = greedy(plan, two_checkpoints[0], "cpu")
    assert "vision" not in res and "pooling" not in res
    batch = res["batches"][0]["float32"]
    assert not res["ok"] and batch["over"] > 0 and batch["max_gap_ulps"] > res["ulps"]
    first = batch["first_diff"]
    assert first["engine_token"] != first["reference_token"] and first["gap"] > first["tolerance"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_the_real_run_refuses_without_a_gpu(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "client.tools.gpu_check", "--out", str(tmp_path)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--dry-run" in proc.stderr


@pytest.mark.slow
def test_the_dry_run_skips_the_tensor_parallel_run_and_says_so(dry_run):
    """Two GPUs are needed for the TP=2 (NCCL) part; the CPU has none: skipped, and the report says so."""
    _, report, _ = dry_run
    tp = results(report)["parts"]["tp"]
    assert tp["ok"] and tp["skipped"] == "needs 2 GPUs; this machine has 0"
    assert "| tp | SKIP | 0 | 900 | needs 2 GPUs; this machine has 0 |" in report


CUT_RUN = """
import sys
from client.tools.gpu_check import run as g

# the kernels part gets one second (it cannot finish), the greedy part enough to be under way;
# the interpreter's probe (a process of its own) is the dry run's test's: here both parts run
from client.tools.gpu_check import plan
plan.budget = lambda part, dry_run: 1 if part.name == "kernels" else 600
plan.interpreter_problem = lambda: None
g.PARTS = tuple(p for p in plan.PARTS if p.name in ("kernels", "greedy"))
sys.exit(g.main(["--dry-run", "--out", sys.argv[1]]))
"""


def _handles_sigterm(parent: int, part: str) -> bool:
    """Whether the run's child process for `part` (its command line names it) has installed its
    SIGTERM handler (run_part's first line): bit 15 of its caught-signals mask in /proc."""
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            fields = dict(line.split(":\t", 1) for line in status.read_text().splitlines() if ":\t" in line)
            cmdline = (status.parent / "cmdline").read_bytes().split(b"\0")
        except OSError:   # the process has gone
            continue
        if int(fields.get("PPid", "0")) == parent and part.encode() in cmdline:
            return bool(int(fields["SigCgt"], 16) >> (signal.SIGTERM - 1) & 1)
    return False


@pytest.mark.slow
def test_a_part_over_its_budget_is_cut_and_sigterm_prints_the_table(tmp_path):
    """A part that overruns its budget is stopped and recorded as cut, and the run goes on; SIGTERM
    to the run stops the part under way (it writes what it has) and prints the table, with every
    part's JSON on disk."""
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-c", CUT_RUN, str(out)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 300
    while not (out / "kernels.json").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    # the greedy part is under way once its process handles SIGTERM (then it imports and loads: on a
    # quick machine the dry run's part is done ~1.5 s after it starts, so the signal follows at once)
    while not _handles_sigterm(proc.pid, "greedy") and time.monotonic() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    stdout, _ = proc.communicate(timeout=120)
    kernels = json.loads((out / "kernels.json").read_text())
    # (whether the part had its own SIGTERM handler yet after 1 s depends on the machine's load)
    assert kernels["cut"] and not kernels["ok"] and kernels["error"].startswith("stopped after 1 s (budget 1 s)"), kernels
    greedy = json.loads((out / "greedy.json").read_text())
    assert greedy["cut"] and greedy["error"] == "stopped by SIGTERM: cut by signal 15; partial results kept", greedy
    assert proc.returncode == 1, stdout
    assert "| part | result | seconds | budget | figures |" in stdout, stdout
    assert "| kernels | CUT |" in stdout and "| greedy | CUT |" in stdout and "stopped: SIGTERM" in stdout
    res = json.loads((out / "gpu_check.json").read_text())
    assert res["stopped"].startswith("SIGTERM") and not res["ok"]


def test_graph_replayed_tokens_must_equal_eager_ones():
    from client.tools.gpu_check.engine import compare_tokens

    eager = {1: [[5, 6, 7]], 16: [[1, 2], [3, 4]]}
    assert compare_tokens({1: [[5, 6, 7]], 16: [[1, 2], [3, 4]]}, eager) == dict(
        ok=True, requests=3, batches=[1, 16], first_diff=None)
    res = compare_tokens({1: [[5, 6, 7]], 16: [[1, 2], [3, 9]]}, eager)
    assert not res["ok"] and res["first_diff"] == dict(batch=16, request=1, position=1, replayed=[9], eager=[4])
    assert not compare_tokens({1: [[5, 6]], 16: [[1, 2], [3, 4]]}, eager)["ok"]     # one came out shorter


def test_only_runs_the_named_parts_and_skips_the_rest(tmp_path, monkeypatch, capsys):
    """`--only decode,greedy` (a rerun of failed parts in what is left of a GPU lease) starts those
    parts alone, in plan order; every other part is SKIP and says why; a misspelt part is refused
    with the list of parts."""
    started = []

    def fake_part(self, name, work, env, budget, limit):
        started.append(name)
        self.record(name, dict(ok=True), time.time(), budget)

    monkeypatch.setattr(gpu_check.Run, "part", fake_part)
    monkeypatch.setattr(gpu_check_plan, "interpreter_problem", lambda: None)
    assert gpu_check.main(["--dry-run", "--only", "decode,greedy", "--out", str(tmp_path)]) == 0
    assert started == ["greedy", "decode"]
    parts = json.loads((tmp_path / "gpu_check.json").read_text())["parts"]
    assert {n for n, p in parts.items() if p.get("skipped") == "not asked for (--only)"} == \
        set(gpu_check_plan.PART_NAMES) - {"greedy", "decode"}
    with pytest.raises(SystemExit) as exc:
        gpu_check.main(["--dry-run", "--only", "decode,kernel", "--out", str(tmp_path)])
    assert exc.value.code == 2 and "unknown part kernel; the parts are compile, kernels" in capsys.readouterr().err
