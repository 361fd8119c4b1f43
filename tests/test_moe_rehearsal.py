"""A Mixtral instance rehearsed as on GPU 1 (tests/test_gpu_rehearsal.py's fake CUDA, tensors on the
CPU, the Triton kernels under the interpreter): the warm-up runs the fused-MoE kernel, decode steps
go through the CUDA graphs' static buffers, the experts' token counts exclude padding rows, and the
metrics port gets `inflight_moe_expert_tokens_total{expert}` and `inflight_moe_load_imbalance`."""
import time

import pytest

from hf_checkpoints import make_checkpoint
from test_gpu_rehearsal import _MetricFamily, rehearsal, tiny_model_dir, triton_args  # noqa: F401 (fixtures)


@pytest.mark.slow
def test_a_moe_instance_on_a_gpu_counts_its_experts_and_serves_decode_from_the_graphs(rehearsal, tmp_path):
    cuda, module, _ = rehearsal
    model_dir = make_checkpoint("mixtral", tmp_path / "mixtral", seed=3)
    model = module.TritonPythonModel()
    try:
        model.initialize(triton_args(model_dir, tmp_path / "model_repository" / "llm"))
        runner = model.engine.engine.runner
        assert runner.ops.name == "triton" and runner.decode_path.graphs is not None
        assert runner.expert_load.counts.sum() == 0          # the warm-up's routing is forgotten
        from backend.core.sampling_params import SamplingParams

        prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14, 15], [16, 17, 18, 19, 20, 21, 22, 23, 24]]
        finished = []
        for i, prompt in enumerate(prompts):
            model.engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
                                     lambda o: o.finished and finished.append(o))
        deadline = time.monotonic() + 120
        while len(finished) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(finished) == 3
        assert runner.decode_path.graphs.replays >= 2                    # decode steps through the static buffers
        stats = model.engine.engine.stats()
        # three decode rows run at the graphs' size 4 (a padding row); real rows only, each counted
        # top_k times in each of the 2 layers: the prompts and the 3 tokens each fed back
        assert sum(stats["moe_expert_tokens"]) == (sum(map(len, prompts)) + 3 * 3) * 2 * 2
        assert stats["moe_load_imbalance"] >= 1.0
        metrics = module.Metrics({"model": "llm", "instance": "llm_0_1", "device": "cuda:1"}, module.pb_utils.MetricFamily)
        metrics.update(stats)
        families = {f.name: f for f in _MetricFamily.created}
        counters = families["inflight_moe_expert_tokens_total"].metrics
        assert [m.labels["expert"] for m in counters] == [str(e) for e in range(8)]
        assert [m.value for m in counters] == stats["moe_expert_tokens"]
        assert families["inflight_moe_load_imbalance"].metrics[0].value == stats["moe_load_imbalance"]
    finally:
        model.finalize()
