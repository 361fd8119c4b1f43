"""The host side of one decode step on the Triton path, measured on a machine with no GPU.

    python -m client.tools.benchmarks.host_overhead [--batches 1,64,256] [--contexts 512,8192] [--json FILE]
    python -m client.tools.benchmarks.host_overhead --before REF     # REF's runner against this one, interleaved

On a GPU a decode step is host-bound when the CPU takes longer to issue the step's work than the
GPU takes to do it. This measures the issuing side without a GPU: the engine's real ModelRunner
(Triton path: the kernel wrappers with their checks and launch plans, the torch ops between them,
step-input building and sampling) runs on CPU tensors, with every compiled-kernel launch replaced
by a no-op that counts it (`kernels.gpu.launch.recording`). The model is Llama-shaped in depth (32
layers, GQA) but tiny in width (hidden 32, vocabulary 2,000), so the torch ops between launches cost
about what dispatching them costs, not arithmetic. What is counted per step:

- `triton`: compiled-kernel launches (each a ~5-20 us argument-binding + driver call on a GPU);
- `torch_ops`: aten operations that are not views (each launches one or more CUDA kernels);
- `h2d`: host arrays turned into tensors for the device (torch.from_numpy / torch.tensor calls);
- `d2h`: reads of tensor values on the host (tolist, item, int(), float(), bool(), cpu(), .to("cpu")),
  each a device synchronization on a GPU.

`host_ms` is the wall time of `ModelRunner.run` with those launches skipped: the wrapper Python,
the torch dispatch, and the CPU arithmetic of the torch ops, which the tiny widths keep small
except where the vocabulary is (the lm_head, and the sampler's sorts over 2,000 tokens in the
`mixed` rows): on a GPU that arithmetic is device work. On a GPU each launch adds its own host
cost to the figure (a few us per torch op, 10-20 us of argument binding per Triton launch). With CUDA graphs (`graphs` rows) the model's forward is
one graph replay on a GPU; here the replay is skipped too and counted as one launch, so the row is
what the host does around it (inputs into static buffers, logits, sampling). The figures are for
comparison between versions of the code on one machine, not GPU timings.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator, Optional

os.environ.setdefault("TRITON_INTERPRET", "1")   # the wrappers accept CPU tensors; nothing runs

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

MODEL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=32, num_attention_heads=2,
             num_key_value_heads=1, vocab_size=2000, max_position_embeddings=16640)
BLOCK_SIZE = 16
KV_BLOCKS = 1024   # the tables point into a small cache: no kernel reads it
COUNTED_STEPS = 3  # steps counted and op-timed (apart from the timed ones)


class Counts:
    def __init__(self) -> None:
        self.triton = self.torch_ops = self.h2d = self.d2h = 0

    def as_dict(self, steps: int) -> dict:
        return {k: v / steps for k, v in vars(self).items()}


class _OpCounter(TorchDispatchMode):
    def __init__(self, counts: Counts):
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view and func.__name__ not in ("detach.default", "lift_fresh.default"):
            self.counts.torch_ops += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def counting(counts: Counts) -> Iterator[None]:
    """Count launches, torch ops, host->device and device->host transfers inside the block."""
    from kernels.gpu import launch
    patches = []

    def patch(owner, name, make):
        original = getattr(owner, name)
        patches.append((owner, name, original))
        setattr(owner, name, make(original))

    def counted(attr):
        def make(original):
            def wrapper(*a, **k):
                setattr(counts, attr, getattr(counts, attr) + 1)
                return original(*a, **k)
            return wrapper
        return make

    for name in ("tolist", "item", "__int__", "__float__", "__bool__", "__index__", "cpu"):
        patch(torch.Tensor, name, counted("d2h"))   # (numpy() refuses a GPU tensor: not counted)

    # Tensors made from host data (kept alive, so their ids stay theirs): their .to(device) is the h2d copy.
    made_on_host: dict[int, torch.Tensor] = {}

    def to_host(original):
        def wrapper(self, *a, **k):
            if id(self) not in made_on_host and any(str(x) == "cpu" for x in (*a, k.get("device"))):
                counts.d2h += 1
            return original(self, *a, **k)
        return wrapper

    def from_host(original):
        def wrapper(*a, **k):
            counts.h2d += 1
            tensor = original(*a, **k)
            made_on_host[id(tensor)] = tensor
            return tensor
        return wrapper

    patch(torch.Tensor, "to", to_host)
    patch(torch, "from_numpy", from_host)
    patch(torch, "tensor", from_host)
    with launch.recording() as launches, _OpCounter(counts):
        try:
            yield
        finally:
            for owner, name, original in reversed(patches):
                setattr(owner, name, original)
            counts.triton += len(launches)


class DecodeBatch:
    """`batch` sequences decoding at `context` cached tokens, as the scheduler's plans describe them
    (backend/core/step.py): whole in the first plan, then each step's new token and, when a table
    grew, its new blocks; `sampling` mixes in the settings that cost the sampler work."""

    def __init__(self, batch: int, context: int, sampling: str, steps: int, seed: int = 0):
        import random

        from backend.core.sampling_params import SamplingParams

        rng = random.Random(seed)
        self.seqs = []
        self.introduced = False
        for i in range(batch):
            params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
            if sampling == "mixed":    # a quarter each: plain random, top-p/k, penalties, logprobs
                kind = i % 4
                params = SamplingParams(max_tokens=steps + 8, ignore_eos=True, temperature=0.8,
                                        top_p=0.9 if kind == 1 else 1.0, top_k=40 if kind == 1 else 0,
                                        repetition_penalty=1.1 if kind == 2 else 1.0,
                                        frequency_penalty=0.2 if kind == 2 else 0.0,
                                        logprobs=2 if kind == 3 else None)
            tokens = [rng.randrange(3, MODEL["vocab_size"]) for _ in range(context + steps + 2)]
            blocks = [rng.randrange(KV_BLOCKS) for _ in range(-(-len(tokens) // BLOCK_SIZE))]
            # id, params, all its tokens, its blocks, its length, its table's length, the length the worker holds
            self.seqs.append([f"{id(self)}-{i}", params, tokens, blocks, context, 0, 0])

    def step_done(self) -> None:
        """Each sequence sampled one more token."""
        for seq in self.seqs:
            seq[4] += 1

    def output(self):
        from backend.core.step import NewSeq, Row, SeqUpdate, StepPlan
        plan = StepPlan()
        for seq in self.seqs:
            sid, params, tokens, blocks, length, table_len, held = seq
            need = -(-length // BLOCK_SIZE)
            if not self.introduced:
                plan.new_seqs.append(NewSeq(sid, tokens[:length - 8], tokens[length - 8:length], params, 0, 0, (), [],
                                            None, (blocks[:need],), length - 1))
            else:
                grown = ((table_len, blocks[table_len:need]),) if need > table_len else ()
                plan.updates.append(SeqUpdate(sid, length - 1, tokens[held:length], blocks=grown))
            seq[5], seq[6] = need, length
            plan.decodes.append(Row(sid, length - 1, 1))
        self.introduced = True
        return plan


def build_runner(model_dir: Path, max_num_seqs: int, max_model_len: int, graphs: bool):
    from backend.core.config import EngineConfig
    from backend.models.loader import load_model_config
    from backend.worker.runner import ModelRunner

    params = dict(model_path=str(model_dir), device="cpu", attention_backend="triton", dtype="float32",
                  max_num_seqs=max_num_seqs, max_tokens_in_paged_kv_cache=KV_BLOCKS * BLOCK_SIZE,
                  kv_block_size=BLOCK_SIZE, max_model_len=max_model_len)
    known = {f for f in EngineConfig.__dataclass_fields__}
    if "enforce_eager" in known:
        params["enforce_eager"] = not graphs
    elif graphs:
        return None   # this version of the engine has no CUDA graphs
    from kernels.gpu import launch
    with launch.recording():   # the warm-up launches nothing real either
        return ModelRunner(EngineConfig(**params), load_model_config(str(model_dir)), max_model_len)


def measure(runner, batch: int, context: int, sampling: str, steps: int, graphs: bool) -> dict:
    from kernels.gpu import launch
    work = DecodeBatch(batch, context, sampling, steps + 4)
    counts = Counts()
    skip = _skip_replay(runner) if graphs else contextlib.nullcontext()
    with torch.inference_mode(), skip:
        with launch.recording():
            for _ in range(2):                      # warm: first-use caches, rows filled
                runner.execute(work.output())
                work.step_done()
        for _ in range(COUNTED_STEPS):
            with counting(counts):
                runner.execute(work.output())
            work.step_done()
        times = []
        with launch.recording():
            for _ in range(steps):
                out = work.output()
                start = time.perf_counter()
                runner.execute(out)
                times.append(time.perf_counter() - start)
                work.step_done()
    row = dict(batch=batch, context=context, sampling=sampling, graphs=graphs,
               host_ms=statistics.median(times) * 1e3, **counts.as_dict(COUNTED_STEPS))
    if graphs:
        row["triton"] += 1   # the replay: one graph launch
    return row


@contextlib.contextmanager
def _skip_replay(runner) -> Iterator[None]:
    """The graphed forward as a no-op: on a GPU it is one replay the host only issues."""
    graphs = runner.decode_path.graphs
    original = graphs.forward_static
    outputs: dict = {}
    hidden = runner.model_cfg.hidden_size
    graphs.forward_static = lambda b: outputs.setdefault(b, torch.zeros(b, hidden))
    try:
        yield
    finally:
        graphs.forward_static = original


def compare(ref: str, argv: list[str], rounds: int) -> int:
    """This probe on git REF's engine and on this one, in separate processes, A B B A per round (a
    shared machine's drift hits both alike); the medians per configuration, as a markdown table."""
    from client.tools.benchmarks.interleave import ab_runs

    results: dict = {}
    for who, runs in ab_runs(ref, "client.tools.benchmarks.host_overhead", argv, rounds).items():
        for run in runs:
            for row in run["rows"]:
                key = (row["sampling"], row["context"], row["batch"])
                name = who if who == "before" else ("graphs" if row["graphs"] else "eager")
                results.setdefault(key, {}).setdefault(name, []).append(row)
    print(f"| sampling | context | batch | before ms | eager ms | graphs ms | before / graphs | "
          f"launches before | eager | graphs | to device before / after | reads back before / after |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |")
    for (sampling, ctx, b), runs in sorted(results.items()):
        med = {k: statistics.median(r["host_ms"] for r in v) for k, v in runs.items()}
        launches = {k: v[0]["triton"] + v[0]["torch_ops"] for k, v in runs.items()}
        first = {k: v[0] for k, v in runs.items()}
        print(f"| {sampling} | {ctx} | {b} | {med['before']:.2f} | {med['eager']:.2f} | {med['graphs']:.2f} | "
              f"{med['before'] / med['graphs']:.1f}x | {launches['before']:.0f} | {launches['eager']:.0f} | "
              f"{launches['graphs']:.0f} | {first['before']['h2d']:.0f} / {first['eager']['h2d']:.0f} | "
              f"{first['before']['d2h']:.0f} / {first['eager']['d2h']:.0f} |")
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m client.tools.benchmarks.host_overhead", description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="1,64,256")
    p.add_argument("--contexts", default="512,8192")
    p.add_argument("--sampling", default="greedy,mixed")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--json", type=Path)
    p.add_argument("--before", metavar="REF", help="compare with the engine at git REF (interleaved runs)")
    p.add_argument("--rounds", type=int, default=1, help="with --before: rounds of A B B A")
    args = p.parse_args(argv)
    if args.before:
        return compare(args.before, ["--batches", args.batches, "--contexts", args.contexts, "--sampling",
                                     args.sampling, "--steps", str(args.steps)], args.rounds)
    from backend.models.make_model import make_model

    batches = [int(b) for b in args.batches.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    torch.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_model(Path(tmp) / "model", seed=1, **MODEL)
        max_len = max(contexts) + args.steps + 16
        for graphs in (False, True):
            runner = build_runner(model_dir, max(batches), max_len, graphs)
            if runner is None:
                continue
            for sampling in args.sampling.split(","):
                for ctx in contexts:
                    for b in batches:
                        row = measure(runner, b, ctx, sampling, args.steps, graphs)
                        rows.append(row)
                        print(f"graphs={'on ' if graphs else 'off'} {sampling:<6} B={b:<4d} ctx={ctx:<5d} "
                              f"host {row['host_ms']:7.2f} ms  triton {row['triton']:5.0f}  "
                              f"torch ops {row['torch_ops']:5.0f}  h2d {row['h2d']:4.0f}  d2h {row['d2h']:4.0f}",
                              flush=True)
            del runner
    if args.json:
        args.json.write_text(json.dumps(dict(model=MODEL, rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
