"""The fused-MoE kernel (kernels/gpu/fused_moe.py) against its torch reference (kernels/moe_reference.py),
and the reference against a per-token loop in float64: several token and expert counts, experts
that get no token, top-1 to top-4, shapes that are not tile multiples, fp32 and fp16 (bf16 on a
GPU only). The sort by expert is checked against its definition, and the wrapper's host side is
checked to read no device value (it runs inside a CUDA graph)."""
import pytest
import torch

from kernels.gpu import fused_moe as fm
from kernels.gpu import launch as launch_mod
from kernels import moe_reference as ref
from kernel_testutil import DEVICE, DTYPES, TOL, assert_close, seed_for
from test_reference_syncs import gpu_branch

HIDDEN, INTER = 40, 48   # neither a multiple of the 64-wide tiles


def make_case(tokens, experts, top_k, dtype, seed, unused=()):
    """Random weights and a routing that never picks the experts in `unused`."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=gen).to(dtype)
    w13 = (torch.randn(experts, 2 * INTER, HIDDEN, generator=gen) / HIDDEN ** 0.5).to(dtype)
    w2 = (torch.randn(experts, HIDDEN, INTER, generator=gen) / INTER ** 0.5).to(dtype)
    logits = torch.randn(tokens, experts, generator=gen)
    logits[:, list(unused)] = -1e9
    weights, ids = ref.route(logits, top_k, renormalize=True)
    return x, w13, w2, weights, ids


def per_token_oracle(x, w13, w2, weights, ids):
    """The definition in float64, one token and one chosen expert at a time."""
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float64)
    inter = w2.shape[2]
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            h = w13[e].double() @ x[t].double()
            act = torch.nn.functional.silu(h[:inter]) * h[inter:]
            out[t] += float(weights[t, k]) * (w2[e].double() @ act)
    return out


# (tokens, experts, top_k, experts given no token)
CASES = [(1, 8, 2, ()), (5, 4, 1, (1, 2)), (37, 8, 2, (0, 5, 6)), (70, 16, 4, (3,)), (150, 4, 2, (2,))]


@pytest.mark.parametrize("tokens,experts,top_k,unused", CASES)
def test_sort_by_expert_matches_its_definition(tokens, experts, top_k, unused):
    _, _, _, _, ids = make_case(tokens, experts, top_k, torch.float32, seed_for("align", tokens, experts), unused)
    block = fm.moe_blocks(tokens * top_k, experts).block_m
    sorted_ids, expert_ids, num_padded = ref.moe_align_block_size(ids, experts, block)
    pairs = tokens * top_k
    flat = ids.reshape(-1).tolist()
    assert sorted_ids.shape[0] == ref.max_padded_pairs(pairs, experts, block) == expert_ids.shape[0] * block
    rows, blocks, used = sorted_ids.tolist(), expert_ids.tolist(), int(num_padded)
    want_rows, want_blocks = [], []
    for e in range(experts):
        mine = [p for p, x in enumerate(flat) if x == e]          # its pairs, in token order
        padded = -(-len(mine) // block) * block
        want_rows += mine + [pairs] * (padded - len(mine))
        want_blocks += [e] * (padded // block)
    assert used == len(want_rows) and rows[:used] == want_rows and blocks[:used // block] == want_blocks
    assert set(rows[used:]) <= {pairs} and set(blocks[used // block:]) <= {-1}
    assert not set(unused) & set(blocks)                           # an expert with no token has no block


@pytest.mark.parametrize("tokens,experts,top_k,unused", CASES)
def test_reference_grouped_and_dense_equal_the_definition(tokens, experts, top_k, unused):
    x, w13, w2, weights, ids = make_case(tokens, experts, top_k, torch.float32, seed_for("ref", tokens), unused)
    want = per_token_oracle(x, w13, w2, weights, ids)
    for impl in (ref.grouped_moe, ref.dense_moe):
        torch.testing.assert_close(impl(x, w13, w2, weights, ids).double(), want, atol=1e-5, rtol=1e-5)
    per_expert = [lambda a, e=e: torch.nn.functional.linear(a, w13[e]) for e in range(experts)]
    down = [lambda a, e=e: torch.nn.functional.linear(a, w2[e]) for e in range(experts)]
    torch.testing.assert_close(ref.grouped_moe(x, per_expert, down, weights, ids).double(), want, atol=1e-5, rtol=1e-5)


def test_the_grouped_path_runs_only_the_experts_that_have_tokens():
    x, w13, w2, weights, ids = make_case(9, 8, 2, torch.float32, seed_for("calls"), unused=(0, 3, 4, 7))
    calls = []

    def layer(w, e):
        return lambda a: (calls.append((e, a.shape[0])), torch.nn.functional.linear(a, w[e]))[1]

    ref.grouped_moe(x, [layer(w13, e) for e in range(8)], [layer(w2, e) for e in range(8)], weights, ids)
    counts = torch.bincount(ids.reshape(-1).long(), minlength=8).tolist()
    assert sorted(set(calls)) == sorted({(e, n) for e, n in enumerate(counts) if n})
    assert sum(n for _, n in calls) == 2 * 2 * 9        # each pair once through gate/up and once through down


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,experts,top_k,unused", CASES)
def test_kernel_matches_the_reference(dtype, tokens, experts, top_k, unused):
    x, w13, w2, weights, ids = make_case(tokens, experts, top_k, dtype, seed_for("kernel", dtype, tokens), unused)
    want = ref.grouped_moe(x, w13, w2, weights, ids)
    got = fm.fused_moe(*(t.to(DEVICE) for t in (x, w13, w2, weights, ids)))
    assert_close(got, want.to(DEVICE), TOL[dtype], f"fused_moe {dtype} T={tokens} E={experts} K={top_k}")


def test_both_tile_configurations_are_exercised():
    assert {fm.moe_blocks(t * k, e).block_m for t, e, k, _ in CASES} == {16, 64}


def test_no_tokens_gives_an_empty_output():
    x, w13, w2, weights, ids = make_case(0, 4, 2, torch.float32, 0)
    assert fm.fused_moe(x, w13, w2, weights, ids).shape == (0, HIDDEN)


def test_the_host_side_reads_no_device_value():
    """The sort and the launches' planning run with every host read of a tensor made to raise (what
    a CUDA graph capture needs); the launches are recorded, not run."""
    x, w13, w2, weights, ids = make_case(6, 8, 2, torch.float32, 1)
    with gpu_branch(), launch_mod.recording() as launches:
        fm.fused_moe(x, w13, w2, weights, ids)
    assert [launch.constexprs["GATED"] for launch in launches] == [True, False]


@pytest.mark.parametrize("change,message", [
    (lambda c: {**c, "w2": c["w2"][:, :, :-1]}, "w2 must be"),
    (lambda c: {**c, "w13": c["w13"][:, :-1]}, "w13 must be"),
    (lambda c: {**c, "topk_ids": c["topk_ids"][:-1]}, "topk_ids"),
    (lambda c: {**c, "topk_weights": c["topk_weights"].half()}, "topk_weights must have dtype"),
    (lambda c: {**c, "w13": c["w13"].half()}, "w13 dtype"),
])
def test_bad_shapes_and_dtypes_are_refused_by_name(change, message):
    x, w13, w2, weights, ids = make_case(4, 4, 2, torch.float32, 2)
    case = change(dict(x=x, w13=w13, w2=w2, topk_weights=weights, topk_ids=ids))
    with pytest.raises(ValueError, match=message):
        fm.fused_moe(**case)


def test_the_kernel_keeps_the_references_signature_and_dispatch_picks_it():
    import inspect

    from kernels import dispatch
    params = lambda f: [(p.name, p.kind, p.default) for p in inspect.signature(f).parameters.values()]  # noqa: E731
    assert params(fm.fused_moe) == params(ref.fused_moe)
    assert dispatch.get_ops("triton", torch.device(DEVICE)).fused_moe is fm.fused_moe
    assert dispatch.get_ops("torch", torch.device("cpu")).fused_moe is ref.fused_moe
    assert dispatch.cpu_ops(torch.float32).fused_moe is ref.fused_moe   # the grouped path on the CPU
