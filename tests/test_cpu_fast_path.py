"""The CPU engine's fast path: oneDNN linears on reordered weights, OpenMP threads pinned to cores,
and which of them an engine picks."""
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from backend.models.float_linear import FloatLinear
from backend.models.packed_linear import (MAX_ROWS, PackedLinear, can_pack, pack_linears, padded_rows,
                                          row_bucket)
from hf_checkpoints import make_checkpoint


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_a_packed_linear_computes_the_linear(bias, rows):
    gen = torch.Generator().manual_seed(rows)
    linear = nn.Linear(96, 200, bias=bias)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(200, 96, generator=gen) * 0.1)
        if bias:
            linear.bias.copy_(torch.randn(200, generator=gen))
    x = torch.randn(rows, 96, generator=gen)
    torch.testing.assert_close(PackedLinear(linear)(x), linear(x), atol=1e-5, rtol=1e-5)
    wide = torch.randn(rows, 192, generator=gen)[:, ::2]  # a strided view, as a split leaves them
    torch.testing.assert_close(PackedLinear(linear)(wide), linear(wide), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("has_bf16", [False, True])
@pytest.mark.parametrize("rows", [1, 13])
def test_bf16_weights_without_onednns_bf16_gemm_stay_bf16_and_multiply_widened(monkeypatch, has_bf16, rows):
    """An AVX2-only CPU's oneDNN has no bf16 GEMM (its reorder raises): the weight stays bfloat16 in
    memory and each call multiplies it widened to float32, exactly the float32 linear on that weight."""
    from kernels.cpu import onednn
    if has_bf16 and not onednn.runs_bf16():
        pytest.skip("oneDNN has no bf16 GEMM on this CPU (AVX2 only)")
    monkeypatch.setattr(onednn, "runs_bf16", lambda: has_bf16)
    gen = torch.Generator().manual_seed(rows)
    linear = nn.Linear(96, 200, bias=True).to(torch.bfloat16)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(200, 96, generator=gen) * 0.1)
        linear.bias.copy_(torch.randn(200, generator=gen))
    packed = PackedLinear(linear)
    assert packed.widen is not has_bf16 and packed.packed.dtype == torch.bfloat16
    x = torch.randn(rows, 96, generator=gen)
    want = x @ linear.weight.float().T + linear.bias.float()  # the bf16 weight, exactly widened
    tolerance = 1e-5 if not has_bf16 else 2e-2               # (oneDNN's bf16 GEMM rounds x to bf16)
    torch.testing.assert_close(packed(x), want, atol=tolerance, rtol=tolerance)
    assert ("widened" in repr(packed)) is not has_bf16


def test_row_counts_fall_in_few_buckets():
    """oneDNN keeps a ~0.6 MB primitive per input shape: every row count may not make its own."""
    buckets = [row_bucket(n) for n in range(1, MAX_ROWS + 1)]
    assert all(b >= n for n, b in zip(range(1, MAX_ROWS + 1), buckets))
    assert buckets == sorted(buckets) and max(buckets) == MAX_ROWS
    assert len(set(buckets)) <= 44
    assert all(b - n < 4 for n, b in zip(range(9, 65), buckets[8:]))  # decode batches: little padding
    assert all(b - n < 16 for n, b in zip(range(65, 257), buckets[64:]))
    assert all(b - n < 256 for n, b in zip(range(257, MAX_ROWS + 1), buckets[256:]))  # chunks: < 256 rows


@pytest.mark.parametrize("rows", [1, 5, 37, 300, MAX_ROWS, MAX_ROWS + 1, 2 * MAX_ROWS + 37])
def test_a_step_is_padded_so_that_every_gemm_slice_is_a_bucket(rows):
    padded = padded_rows(rows)
    assert rows <= padded < rows + 256
    slices = [min(MAX_ROWS, padded - start) for start in range(0, padded, MAX_ROWS)]
    assert all(row_bucket(n) == n for n in slices)


def test_long_inputs_run_in_slices_that_reuse_the_buckets(monkeypatch):
    linear = nn.Linear(32, 48)
    packed = PackedLinear(linear)
    seen = []
    real = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda x, *a: seen.append(x.shape[0]) or real(x, *a))
    x = torch.randn(2 * MAX_ROWS + 37, 32)
    torch.testing.assert_close(packed(x), linear(x), atol=1e-5, rtol=1e-5)
    assert seen == [MAX_ROWS, MAX_ROWS, row_bucket(37)]


def test_pack_linears_replaces_every_linear_and_keeps_the_outputs():
    gen = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.SiLU(), nn.Sequential(nn.Linear(32, 8, bias=False)))
    for p in model.parameters():
        with torch.no_grad():
            p.copy_(torch.randn(p.shape, generator=gen))
    x = torch.randn(5, 16, generator=gen)
    expected = model(x)
    assert pack_linears(model) == 2
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    torch.testing.assert_close(model(x), expected, atol=1e-4, rtol=1e-5)


def test_only_cpu_float_weights_are_packed():
    assert can_pack(torch.device("cpu"), torch.float32)
    assert can_pack(torch.device("cpu"), torch.bfloat16)
    assert can_pack(torch.device("cpu"), torch.float16)  # from a float32 copy (oneDNN has no fp16 GEMM here)
    assert not can_pack(torch.device("cuda"), torch.float32)
    linear = nn.Linear(64, 8, bias=False).to(torch.float16)
    packed, x = PackedLinear(linear), torch.randn(3, 64)
    assert packed.dtype == torch.float32
    torch.testing.assert_close(packed(x), x @ linear.weight.float().T, atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return make_checkpoint("llama", tmp_path_factory.mktemp("llama"), seed=5)


@pytest.mark.parametrize("backend,packed,ops", [("auto", True, "cpu"), ("torch", False, "torch")])
def test_the_cpu_engine_packs_only_on_its_fast_path(llama_dir, backend, packed, ops):
    from backend import LLM, SamplingParams
    llm = LLM(str(llama_dir), attention_backend=backend)
    runner = llm.engine.runner
    assert runner.ops.name == ops
    # the fast path: float_gemm.c (FloatLinear, issue 47), or oneDNN's PackedLinear where that is kept
    assert isinstance(runner.model.layers[0].mlp.down_proj, (FloatLinear, PackedLinear)) == packed
    out = llm.generate([[5, 6, 7, 8, 9]], SamplingParams(max_tokens=6, temperature=0.0))
    assert len(out[0].token_ids) == 6


def test_both_paths_decode_the_same_greedy_tokens(llama_dir):
    from backend import LLM, SamplingParams
    prompts = [[(7 * i + j) % 200 + 3 for j in range(n)] for i, n in enumerate([5, 17, 33, 40])]
    params = SamplingParams(max_tokens=12, temperature=0.0)
    fast = [o.token_ids for o in LLM(str(llama_dir)).generate(prompts, params)]
    plain = [o.token_ids for o in LLM(str(llama_dir), attention_backend="torch").generate(prompts, params)]
    assert fast == plain


PIN_SCRIPT = """
import os, sys, torch
from backend.worker.cpu_affinity import allowed_cores, pin_omp_threads
n = int(sys.argv[1])
torch.set_num_threads(n)
placed = pin_omp_threads(n)
print(sorted(placed.items()), sorted(os.sched_getaffinity(0)), allowed_cores())
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to pin two threads")
def test_two_threads_are_pinned_one_per_core():
    cores = sorted(os.sched_getaffinity(0))
    out = subprocess.run([sys.executable, "-c", PIN_SCRIPT, "2"], capture_output=True, text=True,
                         cwd=os.path.dirname(os.path.dirname(__file__)), check=True).stdout
    assert out.strip() == f"{[(0, cores[0]), (1, cores[1])]} {[cores[0]]} {cores}"


def test_pinning_more_threads_than_cores_is_refused():
    from backend.worker.cpu_affinity import allowed_cores, pin_omp_threads
    with pytest.raises(ValueError, match="cannot pin"):
        pin_omp_threads(len(allowed_cores()) + 1)


def test_a_pinned_thread_still_counts_every_core(monkeypatch):
    """Pinning narrows the engine thread to one core; a second engine built on that thread (the
    step probe builds several) must still get one thread per core but one, not one thread."""
    from backend.worker import cpu_affinity
    from kernels import cpuinfo
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(cpuinfo, "_ALLOWED", tuple(range(8)))  # as first seen, before pinning
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})  # the thread as pinning left it
    assert cpu_affinity.cpu_threads() == 7


FAULT_SCRIPT = """
import resource, sys, torch
from backend import LLM
LLM(sys.argv[1])  # a CPU engine sets the malloc thresholds as it starts (backend/worker/cpu_memory.py)
def steps(n):  # the activations of a 4,096-row prefill step come and go: 50 MB and 12 MB tensors
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(n):
        a = torch.empty(50 * 2**18).fill_(1.0)
        b = torch.empty(12 * 2**18).fill_(2.0)
        del a, b
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
steps(10)  # the heap settles
print(steps(10))
"""


@pytest.mark.slow
@pytest.mark.parametrize("mallopt", ["1", "0"])
def test_the_cpu_engine_keeps_freed_activations_off_fresh_pages(llama_dir, mallopt):
    """With glibc's defaults each 50 MB tensor is mmapped anew and faults in all 12,800 of its
    pages; with the engine's thresholds the freed memory is reused and, once the heap has grown to
    the working set, nothing faults."""
    env = dict(os.environ, INFLIGHT_CPU_MALLOPT=mallopt)
    out = subprocess.run([sys.executable, "-c", FAULT_SCRIPT, str(llama_dir)], capture_output=True, text=True,
                         env=env, cwd=os.path.dirname(os.path.dirname(__file__)), check=True).stdout
    faults = int(out.strip().splitlines()[-1])
    if mallopt == "1":
        assert faults < 1000
    else:
        assert faults > 10 * 12800


def _staggered_greedy(model_dir, backend):
    """Requests join a running batch (decode rows and prefill chunks in one step) and leave it.
    Pacing off: the pacer sizes chunks from measured step times, so under load the same requests
    took 37 steps or more than the 40 here (a clean-clone run failed so); off, the schedule is the
    same in every run and for both backends (25 steps)."""
    from backend import LLM, SamplingParams
    engine = LLM(str(model_dir), attention_backend=backend, max_num_batched_tokens=48, inter_token_target_ms=0).engine
    prompts = [[(11 * i + 3 * j) % 200 + 3 for j in range(n)] for i, n in enumerate([7, 21, 3, 50, 13, 30])]
    tokens = {}
    for step in range(40):
        if step < len(prompts):
            engine.add_request(str(step), prompts[step], SamplingParams(max_tokens=5 + 3 * step, temperature=0.0))
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = out.token_ids
    assert not engine.has_work() and engine.blocks.num_used_blocks == 0
    return [tokens[str(i)] for i in range(len(prompts))]


def test_padded_steps_decode_what_unpadded_ones_do(llama_dir, monkeypatch):
    """The fast path pads each step to a GEMM bucket with rows of empty sequences; the layers'
    GEMMs then pad nothing (only the lm_head, on the sampled rows, may), and the tokens are the
    plain path's. (oneDNN's float layers: INFLIGHT_FLOAT_GEMM=onednn; float_gemm.c's pad nothing.)"""
    monkeypatch.setenv("INFLIGHT_FLOAT_GEMM", "onednn")
    seen = []
    real = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda x, *a: seen.append(x.shape[0]) or real(x, *a))
    pads = []
    real_pad = torch.nn.functional.pad
    monkeypatch.setattr(torch.nn.functional, "pad", lambda *a, **k: pads.append(1) or real_pad(*a, **k))
    fast = _staggered_greedy(llama_dir, "auto")
    assert seen and all(row_bucket(n) == n for n in seen)
    steps_with_samples = len(seen) // (4 * 2 + 1)  # the test model: 2 layers of 4 GEMMs, then lm_head
    assert len(pads) <= steps_with_samples, "a layer GEMM padded its input"
    assert fast == _staggered_greedy(llama_dir, "torch")
