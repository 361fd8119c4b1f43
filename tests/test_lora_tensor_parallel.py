"""Multi-LoRA under tensor parallelism, with real worker processes (gloo on this CPU): TP=1 is the
oracle of TP=2 (and test_lora_engine.py shows TP=1 equal to PEFT's merged models). Each rank holds
its shard of every resident adapter: column-parallel B rows, row-parallel A columns whose partial
deltas join the partial outputs before the all-reduce, so adapters add no collective. Adapters
loaded at run time reach the workers through the group's store; max_loras=1 makes the ranks
rewrite their slots as rank 0 says."""
from __future__ import annotations

import psutil
import pytest
import torch

from backend import LLM, LoRARequest
from backend.models.make_model import make_model
from backend.models.parallel.plan import ShardPlan
from lora_adapters import AdapterSpec, make_adapter
from tp_helpers import greedy, random_prompts, tp_workers

SPECS = {
    "a": AdapterSpec(r=8, alpha=16),
    "b": AdapterSpec(r=16, alpha=8, targets=("q_proj", "v_proj", "o_proj"), use_rslora=True, b_std=0.1),
    "c": AdapterSpec(r=4, alpha=4, targets=("k_proj", "gate_proj", "up_proj", "down_proj"), b_std=0.1,
                     rank_pattern={"down_proj": 12}, layers=(1, 3)),
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-tp")
    base = make_model(root / "base")
    return base, {n: make_adapter(base, root / n, seed=10 + i, spec=s) for i, (n, s) in enumerate(SPECS.items())}


def test_a_lora_pair_splits_so_the_ranks_deltas_add_up_to_the_whole():
    gen = torch.Generator().manual_seed(0)
    x, a, b = torch.randn(5, 24, generator=gen), torch.randn(6, 24, generator=gen), torch.randn(40, 6, generator=gen)
    whole = x @ a.T @ b.T
    plans = [ShardPlan(r, 4, 100) for r in range(4)]
    # row-parallel (o_proj, down_proj): each rank sees its slice of x; the partial deltas sum to the whole
    partial = [plan.shard_lora("o_proj", a, b) for plan in plans]
    assert all(torch.equal(pb, b) for _, pb in partial)
    summed = sum(x[:, r * 6:(r + 1) * 6] @ pa.T @ pb.T for r, (pa, pb) in enumerate(partial))
    assert torch.allclose(summed, whole, atol=1e-4)
    # column-parallel (q/k/v, gate/up): whole x, each rank its output columns
    column = [plan.shard_lora("up_proj", a, b) for plan in plans]
    assert all(torch.equal(ca, a) for ca, _ in column)
    assert torch.allclose(torch.cat([x @ ca.T @ cb.T for ca, cb in column], dim=1), whole, atol=1e-4)
    with pytest.raises(ValueError, match="LoRA on lm_head is not split"):
        plans[0].shard_lora("lm_head", a, b)


@pytest.mark.slow
def test_tp2_serves_three_adapters_and_the_base_in_one_batch_as_one_rank_does(tiny):
    base, adapters = tiny
    prompts = random_prompts(8, seed=5)
    prompts[1] = prompts[3] = prompts[5] = prompts[7] = prompts[0]  # one prompt under every adapter and none
    names = ["a", "b", None, "c", "c", None, "b", "a"]
    lora = dict(enable_lora=True, max_loras=3, lora_modules=",".join(f"{n}={p}" for n, p in adapters.items()))
    params = greedy(10)
    expected = LLM(str(base), max_model_len=256, **lora).generate(prompts, params, lora_request=names)
    with LLM(str(base), max_model_len=256, tensor_parallel_size=2, **lora) as two:
        got = two.generate(prompts, params, lora_request=names)
        runner = two.engine.runner
        assert runner.lora.bank.shard_bounds["o_proj"][-1] == runner.whole_model_cfg.hidden_size  # B whole
        assert runner.lora.bank.fan_in["o_proj"] * 2 == runner.whole_model_cfg.num_heads * runner.whole_model_cfg.head_dim
        calls = runner.tp.stats()["calls"]
        assert calls["all_reduce"] == calls["step_message"] * (2 * runner.model_cfg.num_layers + 1)  # none added
        two.check_integrity()
        workers = tp_workers()
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    same = [got[i].token_ids for i in (0, 1, 3, 5)]   # prompt 0 under a, b, c and none
    assert len({tuple(t) for t in same}) == 4, same
    psutil.wait_procs(workers, timeout=10)
    assert not tp_workers()


def _run_time_loads(llm, adapters):
    """Load at run time, swap one slot between adapters (max_loras=1), reload a name from another
    folder, and a LoRARequest with a path: each phase's tokens."""
    prompts, params = random_prompts(4, seed=9), greedy(8)
    out = []
    llm.load_lora("x", str(adapters["a"]))
    out += [o.token_ids for o in llm.generate(prompts, params, lora_request=["x", None, "x", None])]
    out += [o.token_ids for o in llm.generate(prompts, params, lora_request=[
        "x", LoRARequest("y", 2, str(adapters["c"])), "x", "y"])]
    llm.unload_lora("x")
    llm.load_lora("x", str(adapters["b"]))  # the same name, another adapter: a new load id
    out += [o.token_ids for o in llm.generate(prompts, params, lora_request=["x", "y", None, "x"])]
    return out


@pytest.mark.slow
def test_adapters_loaded_at_run_time_reach_every_rank_and_one_a_rank_cannot_read_fails_it(tiny, tmp_path):
    """Then, on the same group: every rank reads an adapter's folder itself (a rank on another
    machine needs the same path there): one that cannot fails as a lost rank does, naming the rank,
    the adapter and the folder, and leaves no process behind."""
    import shutil

    base, adapters = tiny
    lora = dict(enable_lora=True, max_loras=1)
    expected = _run_time_loads(LLM(str(base), max_model_len=256, **lora), adapters)
    folder = tmp_path / "gone"
    shutil.copytree(adapters["a"], folder)
    with LLM(str(base), max_model_len=256, tensor_parallel_size=2, **lora) as two:
        got = _run_time_loads(two, adapters)
        two.check_integrity()
        assert two.stats()["kv_blocks_used"] == 0
        two.load_lora("z", str(folder))  # rank 0 reads it here; rank 1 when a step first needs it
        workers = tp_workers()
        shutil.rmtree(folder)
        out = two.generate([[5, 6, 7, 8]], greedy(4), lora_request="z")[0]
        assert out.finish_reason == "error"
        assert f"tensor-parallel rank 1 failed: ValueError: LoRA adapter 'z' ({folder}): no adapter folder there" in out.error
    assert got == expected
    assert got[0] != got[8] and got[4] != got[8]   # "x" answered as a, then as b
    psutil.wait_procs(workers, timeout=10)
    assert not tp_workers()
