"""The segmented LoRA kernels (kernels/gpu/lora_sgmv.py) against their torch reference
(kernels/lora_reference.py), and the reference against a per-row loop of plain matmuls: segments
of several lengths (not multiples of the 16-row tile), rows of no adapter between them, padded
segment tables (slot -1), fused shards (q | k | v of unequal widths), fp32 and fp16."""
import pytest
import torch

from kernels import lora_reference as ref
from kernels.gpu import lora_sgmv
from kernel_testutil import DEVICE, DTYPES, assert_close, seed_for

QKV = (0, 40, 56, 72)  # q 40, k 16, v 16 output columns: shards of unequal width
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=2e-2, rtol=2e-2),
       torch.bfloat16: dict(atol=6e-2, rtol=6e-2)}


def make_case(dtype, bounds, seed, rank=16, slots=3, k=48, rows=45):
    gen = torch.Generator().manual_seed(seed)
    shards = len(bounds) - 1
    x = torch.randn(rows, k, generator=gen).to(dtype)
    a_bank = (torch.randn(slots, shards * rank, k, generator=gen) / k ** 0.5).to(dtype)
    b_bank = (torch.randn(slots, bounds[-1], rank, generator=gen) * 0.1).to(dtype)
    out = torch.randn(rows, bounds[-1], generator=gen).to(dtype)
    # rows 0-2 base, 3-19 slot 1 (17 rows), 20-21 base, 22 slot 0 (1 row), 23-44 slot 2 (22 rows)
    runs = [(3, 20, 1), (22, 23, 0), (23, 45, 2)]
    return x, a_bank, b_bank, out, runs


def device_segments(runs, pad=2):
    table = torch.tensor([[s, e - s, slot] for s, e, slot in runs] + [[0, 0, -1]] * pad, dtype=torch.int32)
    table = table.t().contiguous().to(DEVICE)  # starts, lens, slots: each contiguous
    return ref.Segments(runs, table[0], table[1], table[2], max(e - s for s, e, _ in runs))


def per_row_oracle(out, x, a_bank, b_bank, bounds, runs):
    """The definition, one row at a time in float64."""
    want = out.double().clone()
    rank = b_bank.shape[2]
    for start, end, slot in runs:
        for row in range(start, end):
            for i in range(len(bounds) - 1):
                y = a_bank[slot, i * rank:(i + 1) * rank].double() @ x[row].double()
                want[row, bounds[i]:bounds[i + 1]] += b_bank[slot, bounds[i]:bounds[i + 1]].double() @ y
    return want


@pytest.mark.parametrize("bounds", [QKV, (0, 32, 64), (0, 24)])
def test_reference_equals_the_per_row_definition(bounds):
    x, a, b, out, runs = make_case(torch.float32, bounds, seed_for("lora-ref", bounds))
    got = ref.lora_add(out.clone(), x, a, b, bounds, ref.Segments(runs))
    assert torch.allclose(got.double(), per_row_oracle(out, x, a, b, bounds, runs), atol=1e-4, rtol=1e-4)
    base = [r for r in range(out.shape[0]) if not any(s <= r < e for s, e, _ in runs)]
    assert torch.equal(got[base], out[base])  # rows of no adapter are untouched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bounds", [QKV, (0, 32, 64), (0, 24)])
def test_kernels_match_the_reference(dtype, bounds):
    x, a, b, out, runs = make_case(dtype, bounds, seed_for("lora-kernel", dtype, bounds))
    x, a, b, out = (t.to(DEVICE) for t in (x, a, b, out))
    segments = device_segments(runs)
    y = lora_sgmv.lora_shrink(x, a, segments)
    y_ref = ref.lora_shrink(x, a, segments)
    rows = torch.cat([torch.arange(s, e) for s, e, _ in runs])
    assert_close(y[rows], y_ref[rows], TOL[dtype], "lora_shrink")
    got = lora_sgmv.lora_add(out.clone(), x, a, b, bounds, segments)
    want = ref.lora_add(out.clone(), x, a, b, bounds, segments)
    assert_close(got, want, TOL[dtype], "lora_add")
    base = [r for r in range(out.shape[0]) if r not in set(rows.tolist())]
    assert torch.equal(got[base], out[base])


def test_a_segment_longer_than_the_grid_bound_is_refused():
    x, a, b, out, runs = make_case(torch.float32, QKV, 1)
    segments = device_segments(runs)
    segments.max_len = 100
    with pytest.raises(ValueError, match="max_len"):
        lora_sgmv.lora_shrink(x.to(DEVICE), a.to(DEVICE), segments)


def test_bad_arguments_are_refused_naming_them():
    x, a, b, out, runs = make_case(torch.float32, QKV, 2)
    x, a, b, out = (t.to(DEVICE) for t in (x, a, b, out))
    segments = device_segments(runs)
    with pytest.raises(ValueError, match="a_bank's last dim"):
        lora_sgmv.lora_shrink(x[:, :40], a, segments)
    y = lora_sgmv.lora_shrink(x, a, segments)
    with pytest.raises(ValueError, match="shard_bounds"):
        lora_sgmv.lora_expand(y, b, (0, 56, 40, 72), segments, out)
    with pytest.raises(ValueError, match="must agree"):
        lora_sgmv.lora_expand(y, b, (0, 40, 56, 70), segments, out)
    with pytest.raises(ValueError, match="power of two"):
        lora_sgmv.lora_expand(y[:, :36], b[:, :, :12], QKV, segments, out)
    with pytest.raises(ValueError, match="device tensors"):
        lora_sgmv.lora_shrink(x, a, ref.Segments(runs))
    bad = device_segments(runs)
    bad.slots = bad.slots.long()
    with pytest.raises(ValueError, match="segments.slots"):
        lora_sgmv.lora_shrink(x, a, bad)
    bad = device_segments(runs)
    bad.starts = torch.stack([bad.starts, bad.starts], 1)[:, 0]  # a strided view: read as flat by a kernel
    with pytest.raises(ValueError, match="segments.starts"):
        lora_sgmv.lora_shrink(x, a, bad)
