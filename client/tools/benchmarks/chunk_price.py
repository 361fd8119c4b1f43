"""What a prompt chunk adds to a step of decode rows, by chunk size and by the chunk's position in
its prompt: the figures prefill pacing (backend/sched/pacing.py) has to learn, measured directly.

    python -m client.tools.benchmarks.chunk_price --model-path models/smollm2-135m-instruct-q4_1 \\
        [--rows 4] [--chunks 1,8,64] [--starts 1024,3000] [--steps 6]

One in-process engine (pacing off): `--rows` streams decode; their decode-only step is timed; then,
per start, one long prompt is prefilled to `start` tokens in large chunks, and the step's token
budget is set to rows + chunk so that each following step carries one `chunk`-token piece of it
beside the decode rows; `--steps` such steps are timed per chunk size, one after another, so a larger
chunk's steps sit further into the prompt (its columns say where: 128-token chunks from 1,024 cover
1,024-1,792, and attention's share grows with the position). Each step is timed by wall
clock and by the process's CPU time (all threads): the CPU time is what a preempting neighbour on a
shared machine cannot inflate. The report is the median step and what the chunk added per prompt
token. OMP_NUM_THREADS sets the engine's threads as usual.

`--csrc DIR` builds the C kernels from DIR (another commit's kernels/cpu/csrc, e.g. `git show` each
file into a folder) instead of this tree's: an A/B of kernel changes runs in turns A B B A, one
process each (a process loads each kernel library once). docs/benchmarks.md, "A prompt token's
price on the CPU", has such a run.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import time


def timed_steps(engine, steps: int) -> tuple[float, float]:
    """Median wall and CPU seconds of `steps` engine steps."""
    wall, cpu = [], []
    for _ in range(steps):
        w, c = time.perf_counter(), time.process_time()
        engine.step()
        wall.append(time.perf_counter() - w)
        cpu.append(time.process_time() - c)
    return statistics.median(wall), statistics.median(cpu)


def measure(model_path: str, rows: int, chunks: list[int], starts: list[int], steps: int, seed: int = 0) -> dict:
    from backend import LLM, SamplingParams

    rng = random.Random(seed)
    big = 1024
    stream_tokens = 10 + 2 * steps + len(starts) * (len(chunks) * steps + max(starts) // big + 2) + 16
    llm = LLM(model_path, max_model_len=max(max(starts) + max(chunks) * steps + 2, 37 + stream_tokens),
              inter_token_target_ms=0, max_num_batched_tokens=rows + big)
    engine = llm.engine
    vocab = engine.vocab_size
    sched = engine.scheduler

    def budget(tokens: int) -> None:  # the next steps' token budget (the scheduler reads its config each step)
        sched.config = dataclasses.replace(sched.config, max_num_batched_tokens=tokens)

    ids = lambda n: [rng.randrange(3, vocab) for _ in range(n)]  # noqa: E731
    for i in range(rows):
        engine.add_request(f"stream{i}", ids(37), SamplingParams(max_tokens=stream_tokens, temperature=0, ignore_eos=True))
    for _ in range(10):
        engine.step()
    base_wall, base_cpu = timed_steps(engine, 2 * steps)
    result = dict(rows=rows, decode_wall_ms=base_wall * 1e3, decode_cpu_ms=base_cpu * 1e3, cells=[])
    for start in starts:
        for chunk in chunks:
            name = f"prompt-{start}-{chunk}"
            engine.add_request(name, ids(start + chunk * steps + 1), SamplingParams(max_tokens=1, temperature=0))
            done = 0
            while done < start:  # to `start` in large chunks, the last one cut at it
                take = min(big, start - done)
                budget(rows + take)
                engine.step()
                done += take
            budget(rows + chunk)
            wall, cpu = timed_steps(engine, steps)
            engine.abort(name)
            result["cells"].append(dict(start=start, chunk=chunk, end=start + chunk * steps, wall_ms=wall * 1e3, cpu_ms=cpu * 1e3,
                                        cpu_ms_per_token=(cpu - base_cpu) * 1e3 / chunk,
                                        wall_ms_per_token=(wall - base_wall) * 1e3 / chunk))
    llm.close()
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--chunks", default="1,8,64")
    ap.add_argument("--starts", default="1024,3000")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--json")
    ap.add_argument("--csrc", help="build the C kernels from this folder's sources (an A/B against another commit)")
    a = ap.parse_args(argv)
    if a.csrc:
        from pathlib import Path

        from kernels.cpu import build as cpu_build
        cpu_build.CSRC = Path(a.csrc).resolve()
    res = measure(a.model_path, a.rows, [int(c) for c in a.chunks.split(",")],
                  [int(s) for s in a.starts.split(",")], a.steps)
    print(f"decode-only step ({a.rows} rows): wall {res['decode_wall_ms']:.1f} ms, CPU {res['decode_cpu_ms']:.1f} ms")
    # the timed chunks follow one another: a larger chunk's steps sit further into the prompt
    print("| chunk start | chunk tokens | positions timed | step wall ms | step CPU ms | CPU ms per prompt token | wall ms per token |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for c in res["cells"]:
        print(f"| {c['start']:,} | {c['chunk']} | {c['start']:,}-{c['end']:,} | {c['wall_ms']:.1f} | {c['cpu_ms']:.1f} | "
              f"{c['cpu_ms_per_token']:.2f} | {c['wall_ms_per_token']:.2f} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(res, csrc=a.csrc or "this tree"), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
