"""A Mixtral instance rehearsed as on GPU 1 (tests/test_gpu_rehearsal.py's fake CUDA, tensors on the
CPU, the Triton kernels under the interpreter): the warm-up runs the fused-MoE kernel, decode steps
go through the CUDA graphs' static buffers, the experts' token counts exclude padding rows, and the
metrics port gets `inflight_moe_expert_tokens_total{expert}` and `inflight_moe_load_imbalance`."""
import threading

import pytest

from hf_checkpoints import make_checkpoint
from test_gpu_rehearsal import _MetricFamily, rehearsal, triton_args  # noqa: F401 (the fixture)


@pytest.mark.slow
def test_a_moe_instance_on_a_gpu_counts_its_experts_and_serves_decode_from_the_graphs(rehearsal, tmp_path):
    cuda, module, _ = rehearsal
    model_dir = make_checkpoint("mixtral", tmp_path / "mixtral", seed=3)
    model = module.TritonPythonModel()
    try:
        model.initialize(triton_args(model_dir, tmp_path / "model_repository" / "llm"))
        runner = model.engine.engine.runner
        assert runner.ops.name == "triton" and runner.graphs is not None
        assert runner.expert_load.counts.sum() == 0          # the warm-up's routing is forgotten
        from backend.request import SamplingParams

        done, outputs = threading.Event(), []
        prompt = [5, 6, 7, 8, 9, 10, 11]
        model.engine.add_request("r", prompt, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
                                 lambda o: (outputs.append(o), o.finished and done.set()))
        assert done.wait(120)
        assert runner.graphs.replays >= 2                    # decode steps through the static buffers
        stats = model.engine.engine.stats()
        # a decode step of 1 row runs at the graphs' size 1; real rows only, each counted top_k
        # times in each of the 2 layers: the prompt and the 3 tokens fed back
        assert sum(stats["moe_expert_tokens"]) == (len(prompt) + 3) * 2 * 2
        assert stats["moe_load_imbalance"] >= 1.0
        metrics = module.Metrics({"model": "llm", "instance": "llm_0_1", "device": "cuda:1"})
        metrics.update(stats)
        families = {f.name: f for f in _MetricFamily.created}
        counters = families["inflight_moe_expert_tokens_total"].metrics
        assert [m.labels["expert"] for m in counters] == [str(e) for e in range(8)]
        assert [m.value for m in counters] == stats["moe_expert_tokens"]
        assert families["inflight_moe_load_imbalance"].metrics[0].value == stats["moe_load_imbalance"]
    finally:
        model.finalize()
