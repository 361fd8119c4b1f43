"""What `inflight gpu-check` runs (client/tools/gpu_check/run.py): its parts, their time budgets, what
each needs, and the sizes of the real run (FULL, on a GPU) and of its CPU rehearsal (DRY).

A part that needs a package or a program this machine lacks is skipped, and the report says which
(a bare GPU image may have torch, triton and transformers but no tritonserver or xgrammar). Nothing
here imports more than the standard library: the plan is printed before torch loads.
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[3]
# The whole run's wall-clock limit on a GPU: one 10-minute command, less a margin for the report,
# the archive of DIR and the interpreter's start. The part budgets below add up to less than it.
TOTAL_BUDGET_S = 560
SETUP_BUDGET_S = 20   # the environment check and the test checkpoint (make_model), before the parts


@dataclass(frozen=True)
class Part:
    name: str
    budget_s: int                    # its wall-clock limit on a GPU (the dry run allows DRY_BUDGET_S)
    what: str
    needs: tuple[str, ...] = ()      # importable modules
    server: bool = False             # a tritonserver binary
    gpus: int = 1                    # GPUs it needs (the dry run: only parts that run on the CPU too)
    interpreted: bool = True         # under the dry run its Triton kernels run in the CPU interpreter


PARTS = (
    Part("compile", 60, "every kernel variant the parts launch, compiled for this GPU in parallel "
                        "processes (kernels.aot), so a cold Triton cache costs one pass, not a stall per part",
         interpreted=False),
    Part("kernels", 100, "each Triton kernel against its torch reference (bf16/fp16/fp32), then timings "
                         "(client/tools/benchmarks/kernel_bench.py); the checks run first and are kept if the time runs out"),
    Part("greedy", 120, "the engine's greedy tokens at batch 1 (a long prompt), 64 and 256 against "
                        "transformers in the engine's dtype, and in float32 (client/tools/gpu_check/greedy.py); images: a "
                        "tiny Gemma 3 with its vision tower, whole and chunked, token-equal to transformers in float32 "
                        "(client/tools/gpu_check/vision.py); pooling: a tiny Qwen3 served with runner pooling, "
                        "embeddings whole and chunked against transformers' hidden states, cosine >= 0.9999, beside a "
                        "greedy request (client/tools/gpu_check/pooling.py)",
         needs=("transformers",)),
    Part("decode", 90, "the engine's decode step against the bandwidth floor, graphs on and off; the "
                       "graph-replayed tokens must equal the eager ones"),
    Part("structured", 30, "a JSON-schema and a choice constraint through the engine on the GPU (the "
                           "token bitmask applied to device logits); the sampling knobs (min_p, logit_bias, "
                           "allowed_token_ids, prompt_logprobs, ...): the device sampler against a numpy "
                           "sampler, and through the engine (client/tools/gpu_check/sampling.py); beam search, its "
                           "copy-on-write KV copies on the device (client/tools/gpu_check/beams.py)",
         needs=("xgrammar",)),
    Part("served", 80, "tritonserver with two engines on GPU 0: device labels, KV sizing one after the "
                       "other, served vs in-process throughput", needs=("tritonclient",), server=True),
    Part("tp", 60, "tensor_parallel_size 2 (NCCL) against one rank: greedy tokens and the decode step",
         gpus=2),
)
PART_NAMES = tuple(p.name for p in PARTS)
DRY_BUDGET_S = 900   # per part on the CPU (the interpreter is slow; timings mean nothing there)

LLAMA_SHAPE = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=16, num_attention_heads=32,
                   num_key_value_heads=8, head_dim=128, vocab_size=32000, max_position_embeddings=16896,
                   rope_theta=500000.0, torch_dtype="bfloat16")
FULL = dict(
    model=LLAMA_SHAPE,
    # the greedy part's images and pooling checkpoints too (they run in fp32: compile.check_shapes)
    compile_models=("gpu-check", "gpu-check-vision", "gpu-check-pooling", "Llama-3.1-8B"),
    compile_dtypes=("bf16", "fp16", "fp32"), compile_max_variants=0,   # 0: all
    structured_attention_backend="auto",
    kernels=["--batches", "1,64,256", "--contexts", "1024,4096,16384", "--skip-engine", "--skip-reference",
             "--skip-tuning", "--iters", "20"],
    greedy_batches=[(1, 15000, 16000), (64, 256, 4096), (256, 32, 512)], max_tokens=32,
    # the greedy part's cases beside the text batches: images (vision.py) and embeddings (pooling.py)
    greedy_cases=("vision", "pooling"),
    expected_dtype="bfloat16", attention_backend="auto", max_num_batched_tokens=8192, max_model_len=16896,
    decode_shapes=[(1, 16384), (64, 4096), (256, 1024)], decode_steps=20,
    # graph-replayed vs eager tokens: batch sizes that are capture sizes (no padding rows), so both
    # paths launch the same kernels on the same shapes and must give the same tokens
    graph_check=dict(batches=(1, 16, 64), prompt=(20, 300), max_tokens=16),
    # tp: TP=2 differs from one rank only in the all-reduces' summation order (a rounding per
    # all-reduce, two per layer): a first difference must be at a top-two logprob gap within this
    tp_near_tie=0.5,
    # the images case's token budgets (vision.py): whole prompts, and 16-token chunks cut before images
    vision_budgets=(("whole", 512), ("chunked", 16)), vision_max_tokens=8,
    server_params={"max_num_seqs": 64, "max_num_batched_tokens": 4096},
    throughput=["--num-requests", "256", "--concurrency", "64", "--max-output-len", "128"],
)
DRY = dict(
    model=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=512),
    # compile: 12 of the model's 22 variants (each kernel once; tests/kernels/test_aot.py compiles
    # every kernel for sm_80 and sm_90); structured: the torch attention (what the part checks is the
    # sampler's and the grammar's side; the interpreted kernels are the kernels, greedy and decode
    # parts' and were half the rehearsal's time here); kernels: kernel_bench's whole CPU rehearsal, its
    # engine step too (tests/kernels/test_gpu_check.py checks its JSON for kernel_bench's command line);
    # greedy: a long prompt alone and a batch of short ones; decode: one batch x context point
    compile_models=("gpu-check",), compile_dtypes=("bf16",), compile_max_variants=12,
    structured_attention_backend="torch",
    kernels=["--dry-run-cpu", "--batches", "1,2", "--contexts", "40", "--engine-contexts", "20", "--skip-reference"],
    greedy_batches=[(1, 60, 80), (4, 3, 30)], max_tokens=4, greedy_cases=("vision", "pooling"),
    expected_dtype="float32", attention_backend="triton", max_num_batched_tokens=48, max_model_len=256,
    decode_shapes=[(3, 20)], decode_steps=3,
    graph_check=dict(batches=(1, 3), prompt=(3, 30), max_tokens=4),
    tp_near_tie=1e-3,
    # chunked only: on the interpreter the images case was half the greedy part (~90 of 180 s), and
    # the chunked run covers what the whole one does (an image's rows in one step) and the cut
    vision_budgets=(("chunked", 16),), vision_max_tokens=4,
    server_params={"max_num_seqs": 8, "cpu_kv_cache_tokens": 2048},
    throughput=["--num-requests", "6", "--concurrency", "3", "--max-output-len", "8", "--warmup", "0"],
)


def part(name: str) -> Part:
    return next(p for p in PARTS if p.name == name)


def budget(p: Part, dry_run: bool) -> int:
    return DRY_BUDGET_S if dry_run else p.budget_s


def skip_reason(p: Part, dry_run: bool, gpus: int, server: Optional[str], interpreter_problem: Optional[str]) -> str:
    """Why this machine cannot run the part ('' if it can): a missing module or server, too few
    GPUs, or (dry run) a CPU interpreter that cannot run the kernels."""
    missing = [m for m in p.needs if importlib.util.find_spec(m) is None]
    lacks = [f"{', '.join(missing)} (not installed: pip install {' '.join(missing)})"] if missing else []
    if p.server and server is None:
        lacks.append("a tritonserver binary (nvidia-pytriton, or NVIDIA's tritonserver image)")
    if lacks:
        return "needs " + " and ".join(lacks)
    if p.gpus > 1 and gpus < p.gpus:
        return f"needs {p.gpus} GPUs; this machine has {gpus}"
    if dry_run and p.interpreted and interpreter_problem:
        return interpreter_problem
    return ""


# A loop bound loaded from memory: what decode attention does. triton 3.6's interpreter turns the
# loaded value into an int with int() on a one-element array, which numpy 2.4 refuses.
_PROBE = """
import torch, triton, triton.language as tl
@triton.jit
def k(p, o):
    n = tl.load(p)
    acc = 0
    for i in range(0, n, 2):
        acc += i
    tl.store(o, acc)
p = torch.tensor([5], dtype=torch.int32); o = torch.zeros(1, dtype=torch.int32)
k[(1,)](p, o)
assert int(o) == 6, int(o)
"""


def interpreter_problem() -> Optional[str]:
    """None if Triton's CPU interpreter runs a kernel with a loaded loop bound, else why not."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    try:
        proc = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        return "Triton's CPU interpreter did not run a 1-program probe kernel in 120 s"
    if proc.returncode == 0:
        return None
    import numpy
    import triton
    last = (proc.stderr.strip().splitlines() or ["?"])[-1][:200]
    return (f"Triton {triton.__version__}'s CPU interpreter cannot run the kernels with numpy {numpy.__version__} "
            f"({last}); numpy < 2.4 runs them (the dry run only: a GPU compiles them)")


def plan_table(dry_run: bool, reasons: dict[str, str]) -> str:
    """The parts, their budgets on a GPU (and in this run) and whether this run will run them."""
    total = sum(p.budget_s for p in PARTS)
    lines = [f"gpu-check plan ({'CPU dry run' if dry_run else 'GPU run'}): parts in order, budgets in seconds; "
             f"on a GPU {SETUP_BUDGET_S} s of set-up + {total} s of parts <= {TOTAL_BUDGET_S} s",
             f"  {'part':<11} {'GPU budget':>10} {'this run':>9}  will",
             *(f"  {p.name:<11} {p.budget_s:>10} {budget(p, dry_run):>9}  "
               f"{'SKIP: ' + reasons[p.name] if reasons.get(p.name) else 'run'}" for p in PARTS)]
    return "\n".join(lines)
