"""The CPU's shared-memory collectives between the tensor-parallel ranks of one machine
(backend/worker/parallel/shm.py): every rank gets the rank-order sum (for two ranks exactly gloo's
a + b), a gather side by side, over many operations of changing sizes (the double-buffered slots
are never overwritten while a rank still reads them), and a rank that never arrives fails the
wait with the group's reason instead of hanging."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from backend.core.errors import RankLostError
from backend.worker.parallel import shm

pytestmark = pytest.mark.skipif(not shm.usable(), reason="needs x86 and /dev/shm")


SLOT = 1 << 12
OPS = 60


def workload(rank: int, seg) -> list:
    """The ops every rank runs in turn: sums and gathers of changing sizes (gen seeded by rank)."""
    gen = torch.Generator().manual_seed(rank)
    results = []
    for i in range(OPS):
        t = torch.randn(1 + (i * 7) % 13, 5 + i % 3, generator=gen)
        results.append(seg.all_gather_last(t).clone() if i % 5 == 4 else seg.all_reduce(t).clone())
    return results


CHILD = """
import sys, torch
sys.path.insert(0, {tests!r})
from test_tp_shm import SLOT, workload
from backend.worker.parallel import shm
rank = int(sys.argv[1])
torch.save(workload(rank, shm.ShmCollectives({name!r}, rank, 3, lambda: None, slot_bytes=SLOT)), sys.argv[2])
"""


@pytest.mark.slow  # three processes spinning: ~6 s of CPU
def test_every_rank_gets_the_rank_order_sum_and_the_gather(tmp_path):
    size = 3
    name = shm.new_segment_name()
    code = CHILD.format(tests=str(Path(__file__).parent), name=name)
    owner = shm.ShmCollectives(name, 0, size, lambda: None, create=True, slot_bytes=SLOT)
    procs = [subprocess.Popen([sys.executable, "-c", code, str(r), str(tmp_path / f"{r}.pt")]) for r in (1, 2)]
    owner.failed = lambda: next((f"rank {r} exited with {p.poll()}" for r, p in zip((1, 2), procs) if p.poll()), None)
    try:
        mine = workload(0, owner)
        for p in procs:
            assert p.wait(60) == 0
    finally:
        for p in procs:
            p.kill()
        owner.close()
    got = {r: torch.load(tmp_path / f"{r}.pt") for r in (1, 2)}
    gens = [torch.Generator().manual_seed(r) for r in range(size)]
    for i in range(OPS):
        parts = [torch.randn(1 + (i * 7) % 13, 5 + i % 3, generator=g) for g in gens]
        want = torch.cat(parts, dim=-1) if i % 5 == 4 else (parts[0] + parts[1]) + parts[2]
        for r, results in ((0, mine), (1, got[1]), (2, got[2])):
            assert torch.equal(results[i], want), (r, i)
    assert not owner.path.exists()


def test_a_rank_that_never_arrives_fails_the_wait_with_the_groups_reason():
    failure = {"reason": None}
    name = shm.new_segment_name()
    seg = shm.ShmCollectives(name, 0, 2, lambda: failure["reason"], create=True)
    try:
        import threading
        threading.Timer(0.2, lambda: failure.update(reason="tensor-parallel rank 1 exited with code 9")).start()
        with pytest.raises(RankLostError, match="rank 1 exited with code 9"):
            seg.all_reduce(torch.ones(4))
    finally:
        seg.close()


def test_a_tensor_larger_than_a_slot_is_not_taken():
    seg = shm.ShmCollectives(shm.new_segment_name(), 0, 2, lambda: None, create=True, slot_bytes=64)
    try:
        assert seg.fits(torch.ones(16)) and not seg.fits(torch.ones(17)) and not seg.fits(torch.ones(8, 4).t())
    finally:
        seg.close()
