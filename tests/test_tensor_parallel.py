"""Tensor parallelism (issue 26): the split and its refusals (heads that do not divide, naming both
numbers; more ranks than GPUs; `--tp 0`), the one-message step, the placement of KIND_MODEL groups
and gpu-check's TP part. The engines that run (greedy equality with one rank, the faults) are
tests/test_tensor_parallel_engine.py; the served path and Triton's view of a lost rank are
tests/e2e/test_tensor_parallel.py."""
import dataclasses
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from backend import LLM
from backend.core.config import EngineConfig
from backend.models.loader import load_model_config
from backend.models.parallel.plan import ShardPlan
from fake_cuda import FakeCuda, FakeGpu, GIB
from tp_helpers import greedy, tp_workers

ROOT = Path(__file__).resolve().parents[1]


# -- the split, without any process ----------------------------------------------------------------

def test_smollm2_heads_do_not_divide_by_2_and_the_error_names_both_numbers():
    from smollm2 import smollm2_dir

    cfg = load_model_config(smollm2_dir())   # fetched if missing: no reliance on test order
    with pytest.raises(ValueError, match=r"tensor_parallel_size 2 does not divide the model's num_attention_heads 9"
                                         r".*num_key_value_heads 3"):
        ShardPlan.check(cfg, 2)
    assert ShardPlan.check(cfg, 3).local_config(cfg).num_kv_heads == 1


def test_the_engine_refuses_smollm2_at_tp2_before_any_rank_starts():
    """The refusal comes from rank 0's own check (a ValueError), not from a worker that started,
    loaded and then failed (a RuntimeError naming that rank)."""
    from smollm2 import smollm2_dir

    with pytest.raises(ValueError, match=r"^tensor_parallel_size 2 does not divide the model's num_attention_heads 9"
                                         r".*num_key_value_heads 3"):
        LLM(str(smollm2_dir()), tensor_parallel_size=2)
    assert not tp_workers()


def test_a_k_split_that_would_cut_a_quantization_group_is_refused_with_the_numbers(default_model_dir):
    cfg = load_model_config(default_model_dir)    # 8 heads of 32: o_proj has 256 inputs
    o_proj = {"model.layers.0.self_attn.o_proj": "Q4_K"}
    with pytest.raises(ValueError, match=r"would cut the quantization groups of model.layers.0.self_attn.o_proj "
                                         r"\(Q4_K\): its 256 inputs split in 2 are 128 per rank, not a multiple of the 256"):
        ShardPlan.check(cfg, 2, quantized=o_proj)
    ShardPlan.check(cfg, 2, quantized={"model.layers.0.self_attn.o_proj": "Q4_1"})   # 128 = 4 groups of 32
    ShardPlan.check(cfg, 2, quantized={"model.layers.0.self_attn.q_proj": "Q4_K"})   # rows split: any count
    with pytest.raises(ValueError, match=r"o_proj \(Q8_0 \(quantization=int8\)\): its 256 inputs split in 16 are 16"):
        ShardPlan.check(dataclasses.replace(cfg, num_heads=16, num_kv_heads=16, head_dim=16), 16, int8=True)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"])
def test_sharded_packed_arrays_are_the_shards_of_the_dequantized_matrix(qtype):
    """docs/quantization.md's arrays cut by rows (column-parallel) and by whole groups of columns
    (row-parallel) dequantize to exactly the same cut of the float matrix."""
    from kernels.quant_reference import ARRAYS, dequantize

    n, k, size = 12, 1024, 4     # 256 inputs per rank: whole super-blocks for the K-quants
    gen = torch.Generator().manual_seed(7)
    cols = {"qweight": k if qtype == "Q8_0" else k // 2, "qhigh": k // 8 if qtype != "Q6_K" else k // 4,
            "scales": k // (256 if qtype.endswith("_K") else 32), "mins": k // (256 if qtype.endswith("_K") else 32),
            "sub_scales": k // (16 if qtype == "Q6_K" else 32), "sub_mins": k // 32}
    parts = {}
    for name in ARRAYS[qtype]:
        if name in ("scales", "mins"):
            parts[name] = (torch.rand(n, cols[name], generator=gen) - 0.5).half()
        elif name == "qweight" and qtype == "Q8_0" or name == "sub_scales" and qtype == "Q6_K":
            parts[name] = torch.randint(-127, 128, (n, cols[name]), generator=gen, dtype=torch.int8)
        else:
            parts[name] = torch.randint(0, 256 if name != "sub_scales" and name != "sub_mins" else 64,
                                        (n, cols[name]), generator=gen, dtype=torch.uint8)
    full = dequantize(qtype, parts)
    for rank in range(size):
        plan = ShardPlan(rank, size, vocab_size=n)
        cut = lambda module: {a: plan.shard(f"model.layers.0.{module}.{a}", t) for a, t in parts.items()}  # noqa: E731
        assert torch.equal(dequantize(qtype, cut("mlp.down_proj")), full[:, rank * k // size:(rank + 1) * k // size])
        assert torch.equal(dequantize(qtype, cut("mlp.up_proj")), full[rank * n // size:(rank + 1) * n // size])


def test_the_vocabulary_split_pads_the_last_rank_and_row_parallel_biases_are_added_once():
    table = torch.arange(10 * 3, dtype=torch.float32).view(10, 3)   # 10 rows over 4 ranks: 3, 3, 3, 1 + 2 zero
    shards = [ShardPlan(r, 4, vocab_size=10).shard("model.embed_tokens.weight", table) for r in range(4)]
    assert all(s.shape == (3, 3) for s in shards)
    assert torch.equal(torch.cat(shards)[:10], table) and not torch.cat(shards)[10:].any()
    bias = torch.ones(5)
    assert torch.equal(ShardPlan(0, 2, 10).shard("model.layers.3.self_attn.o_proj.bias", bias), bias)
    assert not ShardPlan(1, 2, 10).shard("model.layers.3.self_attn.o_proj.bias", bias).any()
    q_bias = torch.arange(8.0)
    assert torch.equal(ShardPlan(1, 2, 10).shard("model.layers.0.self_attn.q_proj.bias", q_bias), q_bias[4:])


def test_a_step_travels_as_one_header_and_one_flat_payload(default_model_dir):
    """Rank 0 sends the step plan itself (deltas by sequence id, pickled); a rank that applies it to
    its own persistent batch builds exactly rank 0's inputs and block tables. Draft distributions
    (only rank 0 samples) do not travel."""
    from backend.core.step import NewSeq, Row, SeqUpdate, StepPlan
    from backend.worker.input_batch import BlockTables, InputBatch
    from backend.worker.parallel.step_message import HEADER_LEN, StepMessage, decode, encode
    from backend.worker.step_inputs import build_step

    def new(sid, prompt, table, computed):
        return NewSeq(sid, prompt, [], greedy(4), 7, 0, (2,), [], None, (table,), computed)

    plans = [StepPlan(new_seqs=[new("p", list(range(1, 38)), [1, 2, 3], 0), new("d", [5, 6, 7], [4], 2)],
                      decodes=[Row("d", 2, 1)], prefills=[Row("p", 0, 37)]),
             StepPlan(updates=[SeqUpdate("p", 37, [9], blocks=((3, [6]),)), SeqUpdate("d", 3, [8])],
                      decodes=[Row("d", 3, 1)], prefills=[Row("p", 37, 3, draft_token_ids=[4, 4],
                                                               draft_probs=torch.ones(2, 5))],
                      finished_ids=["gone"])]
    leader = InputBatch(BlockTables(4, 8, 16, torch.device("cpu")))
    follower = InputBatch(BlockTables(1, 8, 16, torch.device("cpu")))   # grows as rank 0's did
    for plan in plans:
        leader.apply(plan)
        step = build_step(plan, leader, 3)
        header, payload = encode(StepMessage(1, 8, plan, ([(3, 4, 0)], [(0, 11)])))
        assert header.shape == (HEADER_LEN,) and payload.dtype == np.int64 and payload.ndim == 1
        message = decode(header, payload.copy())
        assert message.graph_size == 8 and message.lora == ([(3, 4, 0)], [(0, 11)])
        assert all(r.draft_probs is None for r in message.plan.prefills)
        follower.apply(message.plan)
        placed = build_step(message.plan, follower, 3)
        for name in ("ids", "positions", "slot_mapping", "decode_rows", "decode_seq_lens", "prefill_rows",
                     "prefill_cu_seqlens_q", "prefill_seq_lens", "sample_index"):
            assert torch.equal(getattr(placed, name), getattr(step, name)), name
        assert (placed.num_decode_rows, placed.decode_max_seq_len, placed.prefill_max_q_len) == \
            (step.num_decode_rows, step.decode_max_seq_len, step.prefill_max_q_len)
        assert torch.equal(follower.tables.table[:, :2], leader.tables.table[:, :2])
    assert follower["p"].all_token_ids == leader["p"].all_token_ids == list(range(1, 38)) + [9]


def test_tensor_parallel_size_0_is_refused_by_config_and_cli(tmp_path):
    with pytest.raises(ValueError, match=r"tensor_parallel_size must be >= 1; got 0"):
        EngineConfig(model_path="x", tensor_parallel_size=0)
    proc = subprocess.run([sys.executable, "-m", "client.cli", "serve", "--tp", "0"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "argument --tp: must be >= 1 (tensor_parallel_size), got 0" in proc.stderr


def test_more_ranks_than_gpus_is_refused_at_load_naming_the_devices(monkeypatch):
    from backend.worker.parallel.rendezvous import local_devices

    FakeCuda(gpus=[FakeGpu(GIB, GIB // 2) for _ in range(4)]).install(monkeypatch)
    assert local_devices(torch.device("cuda", 2), 2) == {1: "cuda:3"}
    with pytest.raises(ValueError, match=r"tensor_parallel_size 3: this engine's ranks need cuda:2 to cuda:4; this "
                                         r"machine has 4 CUDA device\(s\)"):
        local_devices(torch.device("cuda", 2), 3)


def test_an_engine_with_more_ranks_than_gpus_is_refused_before_any_rank_starts(monkeypatch, default_model_dir):
    FakeCuda(gpus=[FakeGpu(GIB, GIB // 2)]).install(monkeypatch)
    with pytest.raises(ValueError, match=r"tensor_parallel_size 2: this engine's ranks need cuda:0 to cuda:1; this "
                                         r"machine has 1 CUDA device\(s\) \(cuda:0 to cuda:0\)"):
        LLM(str(default_model_dir), device="cuda:0", tensor_parallel_size=2)
    assert not tp_workers()


def test_kind_model_instances_take_disjoint_device_groups(monkeypatch, tmp_path, default_model_dir):
    """instance_group [{count: 2 kind: KIND_MODEL}] with tensor_parallel_size 2 on 4 GPUs: llm_0_0
    on cuda:0 (+ cuda:1), llm_0_1 on cuda:2 (+ cuda:3); without GPUs both on the CPU."""
    from adapter_module import load_adapter
    from backend.worker.parallel.rendezvous import local_devices

    adapter = load_adapter()
    params = {"model_path": str(default_model_dir), "tensor_parallel_size": "2"}
    assert adapter.engine_config(params, "MODEL", "0", tmp_path, "llm_0_1").device == "cpu"
    FakeCuda(gpus=[FakeGpu(GIB, GIB // 2) for _ in range(4)]).install(monkeypatch)
    groups = []
    for name in ("llm_0_0", "llm_0_1"):
        device = torch.device(adapter.engine_config(params, "MODEL", "0", tmp_path, name).device)
        groups.append({device.index} | {torch.device(d).index for d in local_devices(device, 2).values()})
    assert groups == [{0, 1}, {2, 3}]
    from templates.render import instance_group, render, tensor_parallel_problem
    assert instance_group([0, 1, 2, 3], 1, tp=2) == "instance_group [ { count: 2 kind: KIND_MODEL } ]"
    assert "share devices" in tensor_parallel_problem(render(gpus=[0, 1, 2, 3]), 2)
    assert tensor_parallel_problem(render(gpus=[0, 2]), 2) == ""


def test_gpu_check_runs_tp2_only_with_two_gpus_and_says_when_it_skipped(monkeypatch):
    from client.tools.gpu_check import plan as gpu_check_plan
    from client.tools.gpu_check import report as gpu_check_report
    from client.tools.gpu_check import tp as gpu_check_tp
    FakeCuda(gpus=[FakeGpu(GIB, GIB // 2)]).install(monkeypatch)
    part = gpu_check_tp.tensor_parallel(gpu_check_plan.FULL, ROOT / "unused")
    assert part == {"ok": True, "skipped": "the TP=2 run (NCCL) needs two GPUs; this machine has 1"}
    res = dict(date="d", device="one GPU", dry_run=False, environment={}, ok=True, wall_s=1.0, problems=[],
               parts={"tp": dict(part, seconds=0.0, budget=60)})
    assert ("| tp | SKIP | 0 | 60 | the TP=2 run (NCCL) needs two GPUs; this machine has 1 |"
            in gpu_check_report.table(res))
    assert gpu_check_report.verdict(res["parts"], dry_run=False) == (True, [])
    # the run itself skips it before starting the part, from the plan
    tp = gpu_check_plan.part("tp")
    assert gpu_check_plan.skip_reason(tp, False, 1, None, None) == "needs 2 GPUs; this machine has 1"


def test_the_split_is_planned_without_torch():
    """plan.py checks a config before any heavy library loads (and stays testable alone)."""
    code = ("import sys, backend.models.parallel.plan\n"
            "print(','.join(m for m in ('torch', 'triton', 'numpy') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == ""
