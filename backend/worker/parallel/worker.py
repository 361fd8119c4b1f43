"""A tensor-parallel rank other than 0: `python -m backend.worker.parallel.worker --rank R [--device D]`.

Rank 0 starts the ranks of its own machine this way (backend/worker/parallel/launcher.py); on other
machines (a second pod, docs/parallelism.md) the same command runs with MASTER_ADDR/MASTER_PORT
pointing at rank 0. The rank joins the group, builds its ModelRunner (its shard of every layer and
of the KV cache) and then computes every step rank 0 sends until rank 0 says STOP, dies, or its
parent does. It never schedules nor samples: everything decided is decided once, by rank 0.
"""
from __future__ import annotations

import argparse
import logging
import sys
import traceback
from typing import Optional

from backend.worker.parent_watch import exit_with_parent


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m backend.worker.parallel.worker", description=__doc__.split("\n")[0])
    parser.add_argument("--rank", type=int, required=True, help="this process's rank, 1 to tensor_parallel_size - 1")
    parser.add_argument("--device", help="cpu or cuda:N (default: rank 0's kind; cuda:$LOCAL_RANK, or cuda:0)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format=f"%(asctime)s rank {args.rank} %(name)s: %(message)s")
    exit_with_parent()  # started by rank 0: never outlive it

    from backend.worker.parallel.rendezvous import join_group  # torch loads here
    from backend.worker.runner import ModelRunner

    try:
        group, config, model_cfg, max_model_len = join_group(args.rank, args.device)
    except Exception as exc:
        print(f"tensor-parallel rank {args.rank}: {exc}", file=sys.stderr)
        return 1
    try:
        runner = ModelRunner(config, model_cfg, max_model_len, tp=group)
        from backend.core.gc_heap import freeze_heap
        freeze_heap()  # a full collection here would hold every rank's step
        while runner.follow():
            pass
    except Exception as exc:
        if group.failure is None:  # rank 0 is alive and waits for this rank: tell it why
            group.report_failure(f"{type(exc).__name__}: {exc}")
            traceback.print_exc()
        else:
            print(f"tensor-parallel rank {args.rank}: {group.failure}", file=sys.stderr)
        return 1
    finally:
        group.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
