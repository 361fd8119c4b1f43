"""client/tools/benchmarks/lora.py, the command behind docs/performance.md's LoRA figures, on the tiny
model: every timed step really runs the adapter count it is filed under (dealt round robin over
one running batch), the `--loop-too` steps run the loop over segments and the others the batched
CPU path, and the engine's batching rule is left as it was."""
from __future__ import annotations

from collections import Counter

from backend.worker.lora import cpu_sgmv
from backend.worker.lora.manager import LoRAManager
from client.tools.benchmarks import lora as lora_bench
def test_each_figure_times_steps_of_its_adapter_count_and_path(default_model_dir, monkeypatch):
    seen: Counter = Counter()
    inner_step, inner_plan = LoRAManager.step, cpu_sgmv.gather_plan
    planned: list = []

    def step(self, runs, writes, num_rows):
        planned.clear()
        lora = inner_step(self, runs, writes, num_rows)
        kind = "batched" if any(p is not None for p in planned) else "loop"
        seen[(len({slot for _, _, slot in runs}), kind if runs else "none")] += 1
        return lora

    def plan(runs, device):
        planned.append(inner_plan(runs, device))
        return planned[-1]

    monkeypatch.setattr(LoRAManager, "step", step)
    monkeypatch.setattr("backend.worker.lora.step.gather_plan", plan)
    waste = cpu_sgmv.MAX_WASTE
    report = lora_bench.run(str(default_model_dir), batch=6, counts=[0, 1, 3], rank=4, context=11, steps=2,
                            rounds=1, seed=0, loop_too=True)

    timed = 1 * 2 * 2  # rounds x steps x (forward and back)
    assert [(r["adapters"], r["path"], r["steps_timed"]) for r in report["rows"]] == [
        (0, "batched", timed), (1, "batched", timed), (3, "batched", timed), (3, "loop", timed)]
    assert report["rows"][0]["vs_base"] == 1.0
    # the timed steps (the prefill before them runs the base model alone: no LoRA step)
    assert seen[(0, "none")] >= timed
    assert seen[(1, "loop")] == timed          # one adapter: the loop, whatever the rule
    assert seen[(3, "batched")] == timed and seen[(3, "loop")] == timed
    assert cpu_sgmv.MAX_WASTE == waste
