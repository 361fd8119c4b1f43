"""The step probe (`inflight bench --step-probe`) and the peer comparison's result check, on a tiny
random checkpoint: what they time, in which order, and that the numbers they report are sane."""
import json

import pytest
import torch

from client.tools.benchmarks import step_floor, step_probe
from client.tools.peers.common import write_result
from hf_checkpoints import make_checkpoint


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return make_checkpoint("llama", tmp_path_factory.mktemp("llama"), seed=2)


def test_interleaved_times_a_b_b_a_and_reports_medians():
    calls = []
    a_s, b_s = step_probe.interleaved(lambda: calls.append("a"), lambda: calls.append("b"), rounds=2)
    assert calls == ["a", "b", "b", "a"] * 2
    assert 0 <= a_s < 0.1 and 0 <= b_s < 0.1


def test_the_floor_is_four_projections_per_layer_and_the_lm_head(llama_dir):
    """Through the model's own linear modules, so the floor uses the engine's GEMM."""
    from backend import LLM
    model = LLM(str(llama_dir)).engine.runner.model
    shapes = []
    for module in model.modules():
        if hasattr(module, "in_features"):
            module.register_forward_hook(lambda m, args, out: shapes.append(
                (tuple(args[0].shape), (m.out_features, m.in_features), tuple(out.shape))))
    step_floor.matmul_floor(model, batch=3)()
    cfg = model.cfg
    assert len(shapes) == 4 * cfg.num_layers + 1
    assert all(x == (3, w[1]) and out == (3, w[0]) for x, w, out in shapes)  # B rows, dims agree
    assert shapes[-1][1] == (cfg.vocab_size, cfg.hidden_size)


def test_probe_decode_reports_engine_and_floor(llama_dir, monkeypatch):
    monkeypatch.setattr(step_probe, "MEMORY_BYTES", 2**24)  # a small buffer keeps the test quick
    row = step_probe.probe_decode(str(llama_dir), batch=2, context=9, steps=2, seed=0)
    assert row["batch"] == 2 and row["engine_step_ms"] > 0 and row["matmul_step_ms"] > 0
    assert row["engine_tok_s"] == pytest.approx(2e3 / row["engine_step_ms"])
    assert row["fraction_of_floor"] == pytest.approx(row["matmul_step_ms"] / row["engine_step_ms"])
    # the bandwidth floor: the step's weight bytes at the measured read bandwidth
    assert row["bandwidth_floor_ms"] == pytest.approx(row["step_weight_mb"] / row["memory_gb_s"])
    assert row["fraction_of_bandwidth_floor"] == pytest.approx(row["bandwidth_floor_ms"] / row["engine_step_ms"])
    assert row["weights_size_read_gb_s"] > 0


def test_each_long_prompt_run_computes_the_whole_prompt(llama_dir, monkeypatch):
    """The A B B A rounds send the same ids to the engine twice: no run may be a prefix hit."""
    from backend import LLM
    runs = []
    generate = LLM.generate

    def counted(self, *args, **kwargs):
        outputs = generate(self, *args, **kwargs)
        runs.extend(o.num_cached_tokens for o in outputs)
        return outputs
    monkeypatch.setattr(LLM, "generate", counted)
    row = step_probe.probe_long_prompt(str(llama_dir), length=53, seed=0)
    assert runs == [0, 0, 0, 0]  # chunked and unchunked, twice each, nothing from the cache
    assert row["engine_chunked_s"] > 0 and row["engine_unchunked_s"] > 0


def test_read_bandwidth_counts_the_bytes_of_the_buffer(monkeypatch):
    """GB/s = the buffer's bytes over the fastest sum: a sum that takes 2 ms on 2**22 floats is 8.4 GB/s."""
    clock = iter([0.0, 0.004, 1.0, 1.002, 2.0, 2.003])
    monkeypatch.setattr(step_probe.time, "perf_counter", lambda: next(clock))
    assert step_probe.read_bandwidth_gb_s(2**24, calls=3) == pytest.approx(2**24 / 0.002 / 1e9)


def test_bench_dispatches_step_probe(llama_dir, tmp_path, capsys):
    from client.tools.benchmarks.bench import main
    out = tmp_path / "probe.json"
    assert main(["--step-probe", "--model-path", str(llama_dir), "--batch-sizes", "1", "--steps", "1",
                 "--context", "4", "--output-json", str(out)]) == 0
    assert [r["batch"] for r in json.loads(out.read_text())["decode"]] == [1]
    assert main(["--step-probe", "--model-path", str(tmp_path / "nope")]) == 2
    assert "is not a folder" in capsys.readouterr().err


def test_a_peer_that_stops_early_is_refused(tmp_path):
    items = [([5, 6, 7], 4), ([8], 2)]
    write_result(tmp_path / "ok.json", "x", 2.0, [4, 2], items)
    assert json.loads((tmp_path / "ok.json").read_text())["output_tok_s"] == 3.0
    with pytest.raises(SystemExit, match="x: 1 of 2 requests did not generate their max_tokens"):
        write_result(tmp_path / "short.json", "x", 1.0, [4, 1], items)


def test_inflights_peer_runner_sizes_its_cache_as_vllm_and_generates_every_token(llama_dir, tmp_path, monkeypatch):
    """run_inflight gets vLLM's KV budget (VLLM_CPU_KVCACHE_SPACE GiB) in tokens, from the same
    bytes-per-token the runner sizes its own cache with, and writes a checked result."""
    import sys
    from backend import LLM
    from client.tools.peers import run_inflight
    items = [([5, 6, 7, 8, 9], 6), ([10, 11], 3), (list(range(3, 40)), 5)]
    workload = tmp_path / "w.json"
    workload.write_text(json.dumps([{"input_ids": p, "max_tokens": n} for p, n in items]))
    made = []
    monkeypatch.setattr("backend.LLM", lambda *a, **k: made.append(k) or LLM(*a, **k))
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "0.001")
    monkeypatch.setattr(sys, "argv", ["run_inflight", "--model-path", str(llama_dir), "--workload", str(workload),
                                      "--out", str(tmp_path / "r.json"), "--warmup", "1"])
    assert run_inflight.main() == 0
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["engine"] == "inflight (none, float32)" and result["output_tokens"] == 14
    assert result["peak_rss_mb"] > 100  # this process's, torch and the model in it
    runner = LLM(str(llama_dir), cpu_kv_cache_tokens=made[0]["cpu_kv_cache_tokens"]).engine.runner
    cache_bytes = sum(k.nbytes + v.nbytes for k, v in runner.kv_caches)
    assert runner.num_blocks == made[0]["cpu_kv_cache_tokens"] // runner.block_size
    assert cache_bytes <= 0.001 * 2**30 < cache_bytes + runner._bytes_per_block()


def test_the_floor_counts_the_weights_as_held(llama_dir, tmp_path):
    """Float weights: 4 bytes each; packed GGUF weights: what the kernel holds (Q4_0: 18 bytes per
    32 weights, tiles of 16 rows padded), so GB/s is of the bytes really read."""
    from backend import LLM
    from backend.models.gguf.importer import import_gguf
    from backend.models.make_model import make_model
    from gguf_files import write_gguf
    floats = LLM(str(llama_dir)).engine.runner.model
    nbytes, count = step_floor.step_weights(floats)
    assert nbytes == 4 * count
    write_gguf(tmp_path / "q.gguf", make_model(tmp_path / "tok") / "tokenizer.json", types=("Q4_0",))
    packed = LLM(str(import_gguf(tmp_path / "q.gguf", tmp_path / "q", log=lambda *_: None))).engine.runner.model
    nbytes, count = step_floor.step_weights(packed)
    assert count * 18 / 32 <= nbytes <= count * 18 / 32 * 1.2
    assert step_floor.gemm_peak_gop_s(packed, rows=8, calls=2) > 0


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    """Qwen3-MoE: 8 experts, top 2, its layer 1 dense (tests/hf_checkpoints.py)."""
    return make_checkpoint("qwen3_moe", tmp_path_factory.mktemp("qwen3_moe"), seed=3)


def test_a_mixture_of_experts_floor_is_its_router_and_the_experts_a_step_reads(moe_dir, monkeypatch):
    """B rows read min(B x top_k, E) experts a layer (`moe_routing`), each counted as held, beside the
    router; a dense layer among them keeps its two projections; and the probe runs end to end."""
    from backend import LLM
    model = LLM(str(moe_dir)).engine.runner.model
    cfg = model.cfg
    blocks = [layer.mlp for layer in model.layers if step_floor._is_moe(layer.mlp)]
    assert 0 < len(blocks) < cfg.num_layers  # the fixture mixes both kinds
    block = blocks[0]
    weights, ids = step_floor.moe_routing(block, 5)
    assert ids.tolist() == [[0, 1], [2, 3], [4, 5], [6, 7], [0, 1]] and weights.sum(1).tolist() == [1.0] * 5
    per_expert = 3 * cfg.hidden_size * block.experts.intermediate
    nbytes, count = {}, {}
    for b in (1, 2, 4, 9):
        nbytes[b], count[b] = step_floor.step_weights(model, b)
        assert nbytes[b] == 4 * count[b]  # float32 weights, held as they are
    assert count[2] - count[1] == len(blocks) * 2 * per_expert  # top 2: two more experts a row
    assert count[9] == count[4]  # every expert already read at 4 rows (4 x 2 = 8)
    # the floor is the experts' GEMMs alone, on the rows sorted by expert (no route, sort or sum)
    from kernels.cpu import moe as cpu_moe
    from kernels.cpu.quant import CpuQuantExperts
    seen = []
    record = lambda rows, offsets: seen.append((rows.shape[0], offsets.tolist())) or torch.zeros(rows.shape[0], 1)  # noqa: E731
    monkeypatch.setattr(CpuQuantExperts, "matmul", lambda self, rows, offsets: record(rows, offsets))
    monkeypatch.setattr(cpu_moe, "expert_gemm", lambda rows, panels, n, offsets, isa=None: record(rows, offsets))
    monkeypatch.setattr(type(block.experts), "forward", lambda *a: pytest.fail("the floor ran the whole experts' call"))
    step_floor.matmul_floor(model, batch=3)()
    assert seen == [(6, [0, 1, 2, 3, 4, 5, 6, 6, 6])] * 2 * len(blocks)   # experts 0-5, a row each; gate/up and down
    monkeypatch.undo()
    monkeypatch.setattr(step_probe, "MEMORY_BYTES", 2**24)
    row = step_probe.probe_decode(str(moe_dir), batch=2, context=9, steps=2, seed=0)
    assert row["engine_step_ms"] > 0 and row["matmul_step_ms"] > 0 and row["gemm_peak_gop_s"] > 0
