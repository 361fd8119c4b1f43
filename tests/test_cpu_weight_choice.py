"""quantization=auto on a packed GGUF folder on the CPU (backend/models/cpu_weight_choice.py): packed
without measuring where the AVX512-VNNI build runs, else the faster of packed and dequantized by a
short measurement (mocked here, so the choice is deterministic); quantization=gguf and none force
either; the choice is logged with its numbers; dequantized weights give the float path's tokens.
"""
import logging
import time

import pytest
import torch

from backend import LLM, SamplingParams
from backend.models.gguf.importer import import_gguf
from backend.models.make_model import make_model
from backend.models import cpu_weight_choice
from backend.models.cpu_weight_choice import StepTimes, choose, measure_steps, measured_matrices
from backend.models.float_linear import FloatLinear
from backend.models.quant_linear import QuantLinear
from kernels.cpu import quant as cpu_quant
from kernels.gpu.quant_bench import random_parts
from gguf_files import write_gguf

SMALL = dict(cpu_kv_cache_tokens=512, max_model_len=256)
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
PROMPTS = [[5, 9, 14, 200, 31], list(range(40, 77))]
DEQUANTIZED_FASTER = [StepTimes(1, 2e-3, 1e-3), StepTimes(16, 8e-3, 5e-3)]
PACKED_FASTER = [StepTimes(1, 1e-3, 9e-3), StepTimes(16, 5e-3, 6e-3)]


def never():
    raise AssertionError("measured where the answer was known")


def test_the_vnni_build_keeps_packed_weights_without_measuring():
    choice = choose("avx512_vnni", never, 10**9, 10**12)
    assert choice.quantization == "gguf" and "avx512_vnni kernel is faster" in choice.reason and not choice.times


@pytest.mark.parametrize("isa", ["avx_vnni", "avx2", "portable", None])
def test_other_builds_measure_and_the_faster_wins(isa):
    calls = []
    deq = choose(isa, lambda: calls.append(1) or DEQUANTIZED_FASTER, 10**9, 10**12)
    assert deq.quantization == "none" and calls == [1] and deq.times == tuple(DEQUANTIZED_FASTER)
    assert "1 row: packed 2.00 ms, dequantized 1.00 ms; 16 rows: packed 8.00 ms, dequantized 5.00 ms" in deq.reason
    assert "dequantized/packed 0.56x, dequantized chosen" in deq.reason  # sqrt(0.5 * 0.625)
    packed = choose(isa, lambda: PACKED_FASTER, 10**9, 10**12)
    assert packed.quantization == "gguf" and "dequantized/packed 3.29x, packed chosen" in packed.reason
    # within MARGIN (10%) the smaller weights stay
    near = [StepTimes(1, 1.05e-3, 1e-3), StepTimes(16, 1.05e-3, 1e-3)]
    assert choose(isa, lambda: near, 10**9, 10**12).quantization == "gguf"
    assert choose(isa, lambda: [], 10**9, 10**12).quantization == "gguf"


def test_dequantized_weights_must_fit_in_half_the_available_memory():
    choice = choose("avx2", never, 6 * 10**9, 11 * 10**9)
    assert choice.quantization == "gguf" and "(6.0 GB) would take more than half" in choice.reason
    assert choose("avx2", lambda: DEQUANTIZED_FASTER, 5 * 10**9, 11 * 10**9).quantization == "none"
    assert choose("avx2", lambda: DEQUANTIZED_FASTER, 5 * 10**9, None).quantization == "none"


def test_the_measured_matrices_are_the_first_layers_fused_and_the_lm_head_cut(monkeypatch):
    gen = torch.Generator().manual_seed(3)
    q8 = lambda n, k: ("Q8_0", random_parts("Q8_0", n, k, "cpu", gen))  # noqa: E731
    items = [("model.embed_tokens", q8(3000, 64)), ("model.norm.weight", torch.ones(64))]
    for layer in (0, 1):
        p = f"model.layers.{layer}."
        items += [(p + "self_attn.q_proj", q8(64, 64)), (p + "self_attn.k_proj", q8(32, 64)),
                  (p + "self_attn.v_proj", ("Q4_0", random_parts("Q4_0", 32, 64, "cpu", gen))),
                  (p + "mlp.gate_proj", q8(96, 64)), (p + "mlp.up_proj", q8(96, 64))]
    got = [(q, a["qweight"].shape[0], round(c, 3)) for q, a, c in measured_matrices(items, 2, True)]
    # q, k, v of two types: one GEMM each; gate+up fused; both layers (under MEASURED_BYTES), once
    # each; the tied lm_head's 3000 rows cut to 2048, its time scaled by 3000 / 2048
    layer = [("Q8_0", 192, 1), ("Q8_0", 64, 1), ("Q8_0", 32, 1), ("Q4_0", 32, 1)]
    assert sorted(got) == sorted(layer * 2 + [("Q8_0", 2048, 1.465)])
    untied = measured_matrices(items + [("lm_head.weight", torch.zeros(3000, 64))], 2, False)
    assert len(untied) == 8  # a float lm_head is float both ways: not measured
    # past MEASURED_BYTES of float32 (here one layer's 320 rows x 64), no more layers: layer 0 counts twice
    monkeypatch.setattr(cpu_weight_choice, "MEASURED_BYTES", 320 * 64 * 4)
    got = [(q, a["qweight"].shape[0], round(c, 3)) for q, a, c in measured_matrices(items, 2, True)]
    assert sorted(got) == sorted([(q, n, 2) for q, n, _ in layer] + [("Q8_0", 2048, 1.465)])


def test_the_measurement_times_both_ways_at_each_row_count(monkeypatch):
    parts = random_parts("Q4_0", 256, 128, "cpu", torch.Generator().manual_seed(0))
    packed_gemm = QuantLinear.forward

    def slow_packed(self, x):  # 10 ms of CPU time more per packed call: which side is which, and the count
        end = time.process_time() + 0.01
        while time.process_time() < end:
            pass
        return packed_gemm(self, x)

    monkeypatch.setattr(QuantLinear, "forward", slow_packed)
    times = measure_steps([("Q4_0", parts, 3.0)], torch.float32, rows=(1, 5))
    assert [t.rows for t in times] == [1, 5]
    assert all(0.03 <= t.packed_s < 0.2 and 0 < t.dequantized_s < 0.01 for t in times), times
    assert measure_steps([], torch.float32) == []


@pytest.fixture(scope="module")
def packed_folder(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("choice")
    tokenizer = make_model(tmp / "tiny") / "tokenizer.json"
    write_gguf(tmp / "model.gguf", tokenizer, seed=5, types=("Q4_1", "Q8_0"), tied=False)
    return import_gguf(tmp / "model.gguf", tmp / "packed", log=lambda *_: None)


def load(folder, monkeypatch, isa, times, **kw):
    """The engine with the quantized-GEMM build reported as ``isa`` and the measurement's result."""
    monkeypatch.setattr(cpu_quant, "chosen_isa", lambda: isa)
    monkeypatch.setattr(cpu_weight_choice, "measure_steps", lambda *a, **k: times)
    return LLM(str(folder), **SMALL, **kw)


def test_the_engine_follows_the_choice_logs_it_and_obeys_forced_values(packed_folder, monkeypatch, caplog):
    with caplog.at_level(logging.INFO, logger="backend.models.cpu_weight_choice"):
        deq = load(packed_folder, monkeypatch, "portable", DEQUANTIZED_FASTER)
    assert deq.engine.runner.weights.quantization == "none"
    assert not any(isinstance(m, QuantLinear) for m in deq.engine.runner.model.modules())
    assert isinstance(deq.engine.runner.model.layers[0].mlp.down_proj, FloatLinear)  # float_gemm.c, issue 47
    assert ("quantization=auto on the CPU: dequantized to float32 (the portable kernel, measured GEMM time of a "
            "step (1 row: packed 2.00 ms") in caplog.text
    assert "dequantized from gguf: faster here" in deq.engine.runner.weights.summary
    packed = load(packed_folder, monkeypatch, "avx2", PACKED_FASTER)
    assert packed.engine.runner.weights.quantization == "gguf"
    assert isinstance(packed.engine.runner.model.layers[0].mlp.down_proj, QuantLinear)
    # the forced values never measure
    monkeypatch.setattr(cpu_weight_choice, "choose", lambda *a: never())
    assert load(packed_folder, monkeypatch, "portable", None, quantization="gguf").engine.runner.weights.quantization == "gguf"
    assert load(packed_folder, monkeypatch, "avx2", None, quantization="none").engine.runner.weights.quantization == "none"


def test_dequantized_by_choice_gives_the_float_paths_and_transformers_tokens(packed_folder, monkeypatch):
    from transformers import AutoModelForCausalLM

    chosen = load(packed_folder, monkeypatch, "avx2", DEQUANTIZED_FASTER)
    assert chosen.engine.runner.weights.quantization == "none"
    forced = LLM(str(packed_folder), quantization="none", **SMALL)
    ours = [o.token_ids for o in chosen.generate(PROMPTS, [GREEDY] * 2)]
    assert ours == [o.token_ids for o in forced.generate(PROMPTS, [GREEDY] * 2)]
    gguf = packed_folder.parent / "model.gguf"
    hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    for prompt, tokens in zip(PROMPTS, ours):
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=8, min_new_tokens=8, do_sample=False)
        assert out[0, len(prompt):].tolist() == tokens
    assert chosen.stats()["kv_blocks_used"] == 0


def test_tensor_parallel_ranks_keep_packed_weights_without_measuring(packed_folder, monkeypatch):
    # each rank loads its own shard: measured apart, ranks could choose differently
    from types import SimpleNamespace

    from backend.core.config import EngineConfig
    from backend.models.loader import load_model_config
    from backend.models.weights import load_model

    monkeypatch.setattr(cpu_quant, "chosen_isa", lambda: "portable")
    monkeypatch.setattr(cpu_weight_choice, "measure_steps", lambda *a, **k: DEQUANTIZED_FASTER)
    monkeypatch.setattr("backend.models.parallel.layers.parallelize", lambda *a: None)
    unsharded = SimpleNamespace(plan=SimpleNamespace(shard_weights=lambda weights: weights))
    config, model_cfg = EngineConfig(model_path=str(packed_folder)), load_model_config(str(packed_folder))
    cpu = torch.device("cpu")
    assert load_model(config, model_cfg, cpu, torch.float32, "cpu").quantization == "none"  # the mock decides
    assert load_model(config, model_cfg, cpu, torch.float32, "cpu", tp=unsharded).quantization == "gguf"
