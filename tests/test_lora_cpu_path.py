"""The batched CPU path (backend/worker/lora/cpu_sgmv.py) against the torch reference's loop over segments
(kernels/lora_reference.py): equal segments (a decode step dealt round robin), unequal ones
(padded), slots with no row between used ones, an adapter with two runs (its decode rows and its
prefill chunk), rows of the base model in between; and the plan declines where the loop is cheaper
(one adapter; padding beyond MAX_WASTE)."""
import pytest
import torch

from backend.worker.lora.cpu_sgmv import gather_plan, lora_add_batched
from kernels.lora_reference import Segments, lora_add

BOUNDS = (0, 40, 56, 72)
CASES = {
    "decode, equal": [(0, 8, 0), (8, 16, 1), (16, 24, 2), (24, 32, 3)],
    "unequal, padded": [(2, 9, 1), (9, 20, 2), (20, 27, 3)],
    "a slot between with no row": [(0, 6, 0), (6, 12, 2)],
    "two runs of one slot, base rows between": [(3, 7, 1), (7, 10, 0), (14, 30, 1), (30, 33, 0)],
    "slots not from 0, rows not multiples of anything": [(1, 4, 2), (4, 9, 3), (9, 11, 2), (11, 18, 3)],
}


@pytest.mark.parametrize("case", list(CASES))
def test_batched_equals_the_loop_over_segments(case):
    runs = CASES[case]
    gen = torch.Generator().manual_seed(len(case))
    rank, k, rows = 16, 48, 40
    x = torch.randn(rows, k, generator=gen)
    a = torch.randn(4, 3 * rank, k, generator=gen) / k ** 0.5
    b = torch.randn(4, BOUNDS[-1], rank, generator=gen)
    out = torch.randn(rows, BOUNDS[-1], generator=gen)
    plan = gather_plan(runs, x.device)
    assert plan is not None
    got = lora_add_batched(out.clone(), x, a, b, BOUNDS, plan)
    want = lora_add(out.clone(), x, a, b, BOUNDS, Segments(runs))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    touched = {r for s, e, _ in runs for r in range(s, e)}
    untouched = [r for r in range(rows) if r not in touched]
    assert torch.equal(got[untouched], out[untouched])


def test_the_plan_declines_where_the_loop_over_segments_is_cheaper():
    cpu = torch.device("cpu")
    assert gather_plan([], cpu) is None
    # one adapter: its rows are slices already (even in two runs)
    assert gather_plan([(5, 37, 3)], cpu) is None
    assert gather_plan([(0, 3, 1), (9, 40, 1)], cpu) is None
    # a 30-row prompt chunk and two decode rows: 3 x 30 positions for 32 rows
    assert gather_plan([(0, 1, 0), (1, 2, 1), (2, 32, 2)], cpu) is None
    # slots 0 and 7 with 4 rows each: 8 x 4 positions for 8 rows
    assert gather_plan([(0, 4, 0), (4, 8, 7)], torch.device("cpu")) is None
    plan = gather_plan([(0, 8, 0), (8, 16, 1)], torch.device("cpu"))
    assert plan.contiguous == (0, 16) and plan.positions is None
