"""The KV tiers on a GPU: one command, one JSON, about a minute on an H100/H200 (docs/design.md, "KV-cache tiers"):

    PYTHONPATH=. python3 -m client.tools.gpu_check.kv_tiers --out DIR        (--dry-run: the CPU, tiny shapes)

On gpu-check's Llama-shaped test checkpoint (client/tools/gpu_check/plan.py's, bfloat16):
copies  The host pool is pinned, the copy stream is not the compute stream, and blocks saved to
        host slots and loaded back into other device blocks come back bit for bit (random bf16
        contents, every layer, K and V); the save and load bandwidth of a plan of `blocks` blocks.
chat    Conversations whose history outgrows the KV cache, with the host tier and without (each
        turn run on both, interleaved): the tiers' hits, the returning turns' TTFT p50 of each and
        the tokens that agree. Not judged on the tokens: bf16 prefill of a whole history and of
        only its new tokens may round differently and flip a near-tie (as prefix caching may); it
        fails on an integrity error, a leak, or no hit.
groups  The same chat on a tiny Gemma 3-shaped checkpoint (transformers writes it: two sliding-window
        layers of 13 tokens and a global one, so the KV cache has several groups and a hit loads
        each group's blocks, the local ones within their window only), judged as `chat`.
Exit 0 when all three pass. DIR/kv_tiers.json holds every figure.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import torch

from backend.kv.tiers.plan import TierPlan


# The sizes of the GPU run and of its CPU rehearsal (beside gpu_check_plan's FULL and DRY).
SIZES = {"gpu": dict(tiers_copy_blocks=512, tiers_kv_tokens=4096, tiers_concurrency=8, tiers_conversations=32,
                     tiers_turns=3, tiers_system_tokens=512, tiers_host_blocks=2048, max_tokens=32, max_model_len=16896),
         "cpu": dict(tiers_copy_blocks=8, tiers_kv_tokens=160, tiers_concurrency=2, tiers_conversations=4,
                     tiers_turns=2, tiers_system_tokens=20, tiers_host_blocks=64, max_tokens=6, max_model_len=256)}


def kv_tiers(plan: dict, model_dir: Path, device: str, grouped_dir: Optional[Path] = None) -> dict:
    copies, chat = _copies(plan, model_dir, device), _chat(plan, model_dir, device)
    groups = _chat(plan, grouped_dir, device) if grouped_dir else None
    return dict(copies=copies, chat=chat, groups=groups,
                ok=copies["ok"] and chat["ok"] and (groups is None or groups["ok"]))


def gemma3_checkpoint(folder: Path, max_len: int) -> Path:
    """A tiny random Gemma 3 text checkpoint (float32), vision.py's text model alone (transformers
    writes it)."""
    import transformers as tf

    from client.tools.gpu_check.vision import gemma3_text_config
    torch.manual_seed(3)
    tf.Gemma3ForCausalLM(gemma3_text_config(max_len)).eval().save_pretrained(folder, safe_serialization=True)
    return folder


def _engine(model_dir: Path, device: str, plan: dict, **tiers):
    from backend import LLM

    return LLM(str(model_dir), device=device, kv_block_size=16, max_model_len=plan["max_model_len"],
               max_tokens_in_paged_kv_cache=plan["tiers_kv_tokens"], max_num_seqs=plan["tiers_concurrency"], **tiers)


def _block_bytes(model_dir: Path, device: str) -> int:
    """A block's bytes (bfloat16 on a GPU, float32 on the CPU): sizes the host pool before the engine is built."""
    from backend.models.loader import load_model_config

    cfg = load_model_config(model_dir)
    return 16 * 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * (4 if device == "cpu" else 2)


def _copies(plan: dict, model_dir: Path, device: str) -> dict:
    n = plan["tiers_copy_blocks"]
    llm = _engine(model_dir, device, {**plan, "tiers_kv_tokens": 2 * n * 16},
                  kv_host_cache_bytes=n * _block_bytes(model_dir, device))
    runner = llm.engine.runner
    copier = runner.kv_copier
    if copier.num_slots < n:
        raise AssertionError(f"the host pool holds {copier.num_slots} blocks, the check needs {n}")
    gen = torch.Generator(device=runner.env.tensor_device).manual_seed(0)
    for kv in runner.kv_caches:
        for cache in kv:
            cache.copy_(torch.randn(cache.shape, generator=gen, device=cache.device).to(cache.dtype))
    on_gpu = runner.env.is_cuda
    pinned = copier.host.is_pinned() if on_gpu else None
    own_stream = copier.stream is not None and copier.stream != runner.env.current_stream() if on_gpu else None
    timings = {}
    for kind, work in (("save", TierPlan(saves=[(b, b) for b in range(n)])),
                       ("load", TierPlan(loads=[(b, n + b) for b in range(n)]))):
        runner.env.synchronize()
        start = time.perf_counter()
        copier.wait(copier.execute(work))
        timings[kind] = time.perf_counter() - start
    runner.env.synchronize()
    exact = all(torch.equal(cache[n:2 * n], cache[:n]) for kv in runner.kv_caches for cache in kv)
    gbs = {k: n * copier.block_bytes / t / 1e9 for k, t in timings.items()}
    llm.close()
    return dict(ok=exact and pinned is not False and own_stream is not False, exact=exact, pinned=pinned,
                own_stream=own_stream, blocks=n, block_bytes=copier.block_bytes,
                save_gbs=round(gbs["save"], 2), load_gbs=round(gbs["load"], 2))


def _chat(plan: dict, model_dir: Path, device: str) -> dict:
    from backend import SamplingParams

    rng = random.Random(7)
    convs, turns = plan["tiers_conversations"], plan["tiers_turns"]
    runs = {"none": _engine(model_dir, device, plan),
            "host": _engine(model_dir, device, plan, kv_host_cache_bytes=plan["tiers_host_blocks"] * _block_bytes(model_dir, device))}
    vocab = runs["none"].engine.vocab_size
    system = [rng.randrange(3, vocab) for _ in range(plan["tiers_system_tokens"])]
    users = [[[rng.randrange(3, vocab) for _ in range(rng.randint(20, 60))] for _ in range(turns)] for _ in range(convs)]
    history = {k: [list(system) for _ in range(convs)] for k in runs}
    ttft = {k: [] for k in runs}
    answers = {k: {} for k in runs}
    params = SamplingParams(max_tokens=plan["max_tokens"], temperature=0, ignore_eos=True)
    for turn in range(turns):
        for name in (("none", "host") if turn % 2 == 0 else ("host", "none")):
            engine = runs[name].engine
            for start in range(0, convs, plan["tiers_concurrency"]):
                reqs = {}
                for c in range(start, min(convs, start + plan["tiers_concurrency"])):
                    history[name][c] += users[c][turn]
                    reqs[c] = engine.add_request(f"{name}-{c}-{turn}", list(history[name][c]), params)
                while engine.has_work():
                    engine.step()
                for c, r in reqs.items():
                    history[name][c] += r.output_token_ids
                    answers[name][(c, turn)] = list(r.output_token_ids)
                    if turn:
                        ttft[name].append(r.first_token_time - r.arrival_time)
    out = {}
    for name, llm in runs.items():
        llm.check_integrity()
        stats = llm.stats()
        tiers = llm.engine.kv_tiers
        out[name] = dict(kv_groups=llm.engine.runner.kv_layout.num_groups,
                         returning_ttft_p50_ms=round(1e3 * statistics.median(ttft[name]), 2),
                         idle=stats["kv_blocks_used"] == 0 and tiers.idle,
                         host_hits=(stats.get("kv_tiers") or {}).get("host", {}).get("hits"))
        llm.close()
    same = sum(answers["host"][k] == answers["none"][k] for k in answers["none"])
    return dict(ok=bool(out["host"]["host_hits"]) and out["host"]["idle"] and out["none"]["idle"],
                answers_equal=f"{same}/{len(answers['none'])}",
                ttft_speedup=round(out["none"]["returning_ttft_p50_ms"] / out["host"]["returning_ttft_p50_ms"], 2), **out)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m client.tools.gpu_check.kv_tiers", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("gpu-check"))
    p.add_argument("--dry-run", action="store_true", help="the CPU, tiny shapes (timings mean nothing)")
    args = p.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_check_tiers needs a CUDA GPU; --dry-run rehearses it on the CPU", file=sys.stderr)
        return 2
    from backend.models.make_model import make_model
    from client.tools.gpu_check.plan import DRY, FULL

    shape = (DRY if args.dry_run else FULL)["model"]
    with tempfile.TemporaryDirectory(prefix="inflight-kv-tiers-check-") as tmp:
        model_dir = make_model(Path(tmp) / "model", seed=3, **shape)
        sizes = SIZES["cpu" if args.dry_run else "gpu"]
        grouped_dir = gemma3_checkpoint(Path(tmp) / "gemma3", sizes["max_model_len"])
        res = kv_tiers(sizes, model_dir, "cpu" if args.dry_run else "cuda:0", grouped_dir)
    res.update(date=time.strftime("%Y-%m-%d %H:%M:%S"), dry_run=args.dry_run,
               device=torch.cuda.get_device_name(0) if not args.dry_run else "cpu")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "kv_tiers.json").write_text(json.dumps(res, indent=1, default=str))
    print(json.dumps(res, indent=1, default=str))
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
