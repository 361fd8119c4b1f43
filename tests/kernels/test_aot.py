"""kernels.aot: every kernel, with the launch configurations the wrappers choose, compiles for sm_80
and sm_90 (the real Triton compiler, no GPU); and a kernel change that the CPU interpreter accepts
but the GPU compiler refuses makes it fail. `make test` compiles two models' kernels, each target in
one dtype; the whole table (9 models, both dtypes, both targets) is the `aot_full` test, which
`make test` leaves out and `make aot` runs.

The compiles run in subprocesses: this test process has TRITON_INTERPRET=1 (tests/conftest.py), and
under it the kernels are interpreter stand-ins that cannot be compiled.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels.gpu import decode_attention as decode_mod
from kernels import reference

ROOT = Path(__file__).resolve().parents[2]
KERNELS = {"store_kv_kernel", "decode_attention_kernel", "decode_merge_kernel", "prefill_attention_kernel",
           "rms_norm_kernel", "rotary_kernel", "gated_act_kernel",
           "gguf_gemm_kernel", "w8_gemm_kernel", "awq_gemm_kernel", "split_k_reduce_kernel",  # kernels/quant_*.py
           "lora_shrink_kernel", "lora_expand_kernel",  # kernels/gpu/lora_sgmv.py
           "fused_moe_kernel"}  # kernels/gpu/fused_moe.py: the MoE models only
CACHE_KERNELS = {"store_kv_kernel", "decode_attention_kernel", "prefill_attention_kernel"}


# A guard against a hung compiler, not a speed check: the whole table (654 compiles since the MoE and
# sliding-window kernels) took over 600 s on two busy cores beside the other test worker.
def run_aot(tmp_path, *args: str, patch: str = "", timeout: float = 1800) -> tuple[int, dict, str]:
    """Run kernels.aot in a fresh process without TRITON_INTERPRET, after `patch` (Python code run
    first: a deliberate breakage). Returns (exit status, the JSON, the output)."""
    out = tmp_path / "aot.json"
    code = (f"import sys\n{patch}\nfrom kernels import aot\n"
            f"sys.exit(aot.main(['--json', {str(out)!r}, *{list(args)!r}]))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    output = proc.stdout[-16000:] + proc.stderr[-4000:]   # the table grew with kernels/quant_*.py
    assert out.exists(), output
    return proc.returncode, json.loads(out.read_text()), output


SUBSET = """
import json, math, sys
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from kernels import aot
# Gemma 3 (sliding windows, GELU, q/k norm) and a MoE model plan every kernel; sm_80 in bf16, sm_90 in
# fp16 (and its fp8 cache). Of their variants: each kernel's largest tile on each target, and every
# value of each of a kernel's switches (SPLIT, SLIDING, SATURATE, QTYPE, GATED, ...) on one of them.
models = {m: aot.MODELS[m] for m in ("Gemma-3-270M", "Qwen3-30B-A3B")}
planned = [aot.collect(models, [d], [t]) for d, t in (("bf16", "sm_80"), ("fp16", "sm_90"))]
rows = [(r, job) for rs, jobs in planned for r, job in zip(rs, jobs.values())]
tile = lambda r: math.prod(v for k, v in r["config"].items() if k.startswith("BLOCK") and isinstance(v, int))
seen, chosen = set(), []
for r, job in sorted(rows, key=lambda rj: -tile(rj[0])):
    fp8 = r["dtype"].endswith("kv-fp8")
    shows = {(r["kernel"], r["target"], fp8)} | {(r["kernel"], fp8, k, json.dumps(v)) for k, v in r["config"].items()
                                               if not k.startswith(("BLOCK", "num_"))}
    if not shows <= seen:
        seen |= shows
        chosen.append((r, job))
with ProcessPoolExecutor(2, mp_context=get_context("spawn")) as pool:
    results = list(pool.map(aot._compile, [job for _, job in chosen]))
for (r, _), (ok, shared, error, seconds) in zip(chosen, results):
    r.update(ok=ok and shared <= aot.TARGETS[r["target"]][1], shared_bytes=shared, error=error)
json.dump(dict(planned=len(rows), rows=[r for r, _ in chosen]), open(sys.argv[1], "w"))
"""


@pytest.mark.slow
def test_every_kernel_compiles_for_sm80_in_bf16_and_for_sm90_in_fp16_and_with_an_fp8_cache(tmp_path):
    """`make test`'s share of the table (a cold Triton cache compiles the whole of it for minutes):
    every kernel for both targets, each target in one dtype, every switch of every kernel once (the
    whole table: the aot_full test below, `make aot`)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "rows.json"
    proc = subprocess.run([sys.executable, "-c", SUBSET, str(out)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert all(r["ok"] for r in rows), sorted({(r["kernel"], r["target"], r["error"][:120]) for r in rows if not r["ok"]})
    assert len(rows) < result["planned"] / 2
    combos = {(r["kernel"], r["dtype"], r["target"]) for r in rows}
    fp8_cache = {(k, "fp16+kv-fp8", "sm_90") for k in CACHE_KERNELS}
    assert combos == {(k, d, t) for k in KERNELS for d, t in (("bf16", "sm_80"), ("fp16", "sm_90"))} | fp8_cache

    def values(kernel, key):
        return {r["config"][key] for r in rows if r["kernel"] == kernel}
    assert values("decode_attention_kernel", "SPLIT") == values("decode_attention_kernel", "SLIDING") == {False, True}
    assert values("prefill_attention_kernel", "SLIDING") == {False, True}
    assert values("store_kv_kernel", "SATURATE") == values("gated_act_kernel", "GELU_TANH") == {False, True}
    assert values("fused_moe_kernel", "GATED") == {0, 1} and values("gguf_gemm_kernel", "QTYPE") == set(range(7))


@pytest.mark.slow
@pytest.mark.aot_full
def test_every_kernel_compiles_for_sm80_and_sm90_in_bf16_and_fp16_and_with_an_fp8_cache(tmp_path):
    rc, result, output = run_aot(tmp_path, "--jobs", "2")
    rows = result["rows"]
    assert rc == 0, output
    assert all(r["ok"] for r in rows), [r for r in rows if not r["ok"]]
    combos = {(r["kernel"], r["dtype"], r["target"]) for r in rows}
    # an fp8 KV cache (kv_cache_dtype=fp8): the kernels that touch the cache, on sm_90 only (e4m3: sm_89+)
    fp8_cache = {(k, d + "+kv-fp8", "sm_90") for k in CACHE_KERNELS for d in ("bf16", "fp16")}
    assert combos == {(k, d, t) for k in KERNELS for d in ("bf16", "fp16") for t in ("sm_80", "sm_90")} | fp8_cache
    assert {r["config"]["SATURATE"] for r in rows if r["kernel"] == "store_kv_kernel"} == {False, True}
    assert {m for r in rows for m in r["models"]} == {"Llama-3.1-8B", "Llama-3.2-1B", "Qwen2-7B", "Mistral-7B",
                                                      "Qwen3-8B", "Gemma-3-4B", "Gemma-3-270M",
                                                      "Mixtral-8x7B", "Qwen3-30B-A3B"}
    moe = [r for r in rows if r["kernel"] == "fused_moe_kernel"]
    # per MoE model, dtype and target: gate/up and down, each in both tile configurations
    assert len(moe) == 2 * 2 * 2 * 2 * 2 and all(len(r["models"]) == 1 for r in moe)
    assert {(r["config"]["GATED"], r["config"]["BLOCK_M"]) for r in moe} == {(g, m) for g in (0, 1) for m in (16, 64)}
    for r in rows:
        assert 0 <= r["shared_bytes"] <= result["targets"][r["target"]]["shared_limit_bytes"], r
    decode = [r for r in rows if r["kernel"] == "decode_attention_kernel"]
    assert {r["config"]["SPLIT"] for r in decode} == {False, True}          # one pass and split-K
    # Gemma 3's local layers: sliding-window attention, both kernels, every dtype and target
    for kernel in ("decode_attention_kernel", "prefill_attention_kernel"):
        assert {(r["dtype"], r["target"]) for r in rows if r["kernel"] == kernel and r["config"]["SLIDING"]} == \
            {(d, t) for d in ("bf16", "fp16") for t in ("sm_80", "sm_90")} | {(d + "+kv-fp8", "sm_90") for d in ("bf16", "fp16")}
    assert {r["config"]["GELU_TANH"] for r in rows if r["kernel"] == "gated_act_kernel"} == {False, True}
    merge = {r["config"]["BLOCK_SPLITS"] for r in rows if r["kernel"] == "decode_merge_kernel"}
    assert merge == {decode_mod.MAX_SPLITS}                                 # one variant serves every count
    assert "0 failed" in output


BREAK_BLOCK_N = "import kernels.gpu.decode_attention as d\nd.DEFAULT_BLOCK_N = 8"  # P@V's K becomes 8


@pytest.mark.slow
def test_a_kernel_that_no_longer_compiles_for_sm90_fails(tmp_path):
    rc, result, output = run_aot(tmp_path, "--models", "Llama-3.2-1B", "--dtypes", "fp16", "--targets", "sm_90",
                                 "--kernels", "decode_attention_kernel,store_kv_kernel", "--jobs", "1",
                                 patch=BREAK_BLOCK_N)
    assert rc == 1, output
    assert {r["kernel"] for r in result["rows"]} == {"decode_attention_kernel", "store_kv_kernel"}  # (--kernels)
    failed = [r for r in result["rows"] if not r["ok"]]
    assert failed and {r["kernel"] for r in failed} == {"decode_attention_kernel"}
    assert all("K >= 16" in r["error"] for r in failed), failed
    assert "FAIL" in output


def test_the_interpreter_runs_what_sm90_refuses():
    """Why the AOT check exists: the same tile (K = 8) runs, and is right, under the interpreter."""
    torch.manual_seed(0)
    s, h, g, d, bs = 2, 4, 2, 32, 16
    q = torch.randn(s, h, d, dtype=torch.float16)
    k_cache = torch.randn(4, bs, g, d, dtype=torch.float16)
    v_cache = torch.randn_like(k_cache)
    tables = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    seq_lens = torch.tensor([5, 30], dtype=torch.int32)
    out = torch.empty_like(q)
    for launch in decode_mod.plan_decode_attention(q, k_cache, v_cache, tables, seq_lens, d ** -0.5, out,
                                                   num_splits=1, block_n=8):
        launch()
    expected = reference.decode_attention(q, k_cache, v_cache, tables, seq_lens, d ** -0.5)
    torch.testing.assert_close(out, expected, atol=3e-3, rtol=3e-3)


@pytest.mark.slow
def test_shared_memory_over_the_target_limit_fails(tmp_path):
    rc, result, output = run_aot(tmp_path, "--models", "Llama-3.2-1B", "--dtypes", "fp16", "--targets", "sm_90",
                                 "--kernels", "decode_attention_kernel,prefill_attention_kernel", "--jobs", "1",
                                 patch="from kernels import aot\naot.TARGETS['sm_90'] = (90, 1024)")
    assert rc == 1, output
    over = [r for r in result["rows"] if not r["ok"]]
    assert over and all(r["shared_bytes"] > 1024 and "shared memory" in r["error"] for r in over)
    assert {r["kernel"] for r in over} >= {"decode_attention_kernel", "prefill_attention_kernel"}


def test_command_line_refuses_unknown_names(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "kernels.aot", "--targets", "sm_75"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--targets" in proc.stderr and "sm_90" in proc.stderr



@pytest.mark.slow
def test_command_line_refuses_a_kernel_the_models_do_not_launch():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "kernels.aot", "--models", "Gemma-3-270M", "--dtypes", "bf16",
                           "--targets", "sm_80", "--kernels", "decode_attention_kernel,no_such_kernel"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=120)  # (refused before any compile)
    assert proc.returncode == 2 and "['no_such_kernel']" in proc.stderr and "prefill_attention_kernel" in proc.stderr


def test_plan_uses_the_gpu_configuration_when_asked():
    """The prefill plan the AOT compiles is the GPU's tile choice, not the interpreter's."""
    from kernels.gpu.prefill_attention import plan_prefill_attention

    q = torch.zeros(4, 8, 128, dtype=torch.float16)
    cache = torch.zeros(2, 16, 2, 128, dtype=torch.float16)
    args = (q, cache, cache, torch.zeros(1, 2, dtype=torch.int32), torch.tensor([0, 4], dtype=torch.int32),
            torch.tensor([4], dtype=torch.int32), 0.1, torch.empty_like(q), 4)
    gpu, cpu = plan_prefill_attention(*args, on_gpu=True), plan_prefill_attention(*args)
    assert (gpu.constexprs["BLOCK_M"], gpu.num_warps, gpu.num_stages) == (128, 8, 3)
    assert (cpu.constexprs["BLOCK_M"], cpu.num_stages) == (32, 1)


def test_sliding_windows_add_one_variant_per_attention_kind(variant_counts):
    """A Gemma 3 (local layers beside global ones): decode and prefill attention compile once more
    each for the window (SLIDING; the window's length is an argument, not a constant), whatever
    the step; the q/k norm adds one RMSNorm variant (rows of head_dim). With two KV groups the
    second group's slots and block tables may start off a 16-byte boundary (aot_launches._alignments):
    the cache kernels compile once more for that, so 2 x 2 decode (one pass, split-K), 2 x 2 prefill
    and 2 store variants."""
    counts = variant_counts["Gemma-3-270M"]["bf16"]
    assert (counts["decode_attention_kernel"], counts["prefill_attention_kernel"], counts["store_kv_kernel"]) == (8, 4, 2)
    assert (counts["rms_norm_kernel"], counts["gated_act_kernel"], counts["decode_merge_kernel"]) == (3, 1, 1)


VARIANTS = """
import json, sys
from kernels import aot
counts = {}
for model in sys.argv[1:]:
    rows, _ = aot.collect({model: aot.MODELS[model]}, ["bf16"], ["sm_90"])
    for r in rows:
        column = counts.setdefault(model, {}).setdefault(r["dtype"], {})
        column[r["kernel"]] = column.get(r["kernel"], 0) + 1
print(json.dumps(counts))
"""


@pytest.fixture(scope="module")
def variant_counts():
    """kernels.aot's planned variants per model, dtype column and kernel (bf16, sm_90), for the two
    tests below: one process (the planning imports the real Triton), not one each."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", VARIANTS, "Llama-3.1-8B", "Gemma-3-270M"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_each_kernel_compiles_to_a_few_variants_whatever_the_step(variant_counts):
    """kernels.aot plans every split count (1..MAX_SPLITS) at several step shapes (tokens, sequences,
    block-table width): the values that change from step to step must not make Triton compile new
    variants (an integer argument equal to 1 or divisible by 16 is specialized unless the kernel
    says not to), or each new one would compile in the middle of serving. What is left is one
    variant per kernel, two for decode attention (one pass, split-K) and RMSNorm (with and without
    the residual): the warm-up runs them all."""
    columns = variant_counts["Llama-3.1-8B"]
    counts = columns["bf16"]
    # an fp8 cache: the same variants again for the kernels that touch the cache, nothing more
    assert columns["bf16+kv-fp8"] == {"decode_attention_kernel": 2, "prefill_attention_kernel": 1, "store_kv_kernel": 1}
    assert set(columns) == {"bf16", "bf16+kv-fp8"}
    assert counts == {"decode_attention_kernel": 2, "decode_merge_kernel": 1, "prefill_attention_kernel": 1,
                      "store_kv_kernel": 1, "rms_norm_kernel": 2, "rotary_kernel": 1, "gated_act_kernel": 1,
                      # the quantized GEMMs: 3 variants (decode 16, decode 64, prefill) per qtype, and the
                      # prefill with bias; a qtype is a constexpr (7 GGUF, 3 8-bit, AWQ)
                      "gguf_gemm_kernel": 21, "w8_gemm_kernel": 9, "awq_gemm_kernel": 3,
                      "split_k_reduce_kernel": 1,
                      # LoRA: the shrink per tile width (16, 32, 64: shards x rank), the expand per
                      # projection shape (qkv, o/down, gate_up) x rank (16, 64), whatever the tokens
                      "lora_shrink_kernel": 3, "lora_expand_kernel": 6}, counts
