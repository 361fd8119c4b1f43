"""A mixture-of-experts block after its router in one C call (kernels/cpu/csrc/moe_block.c): the
route against kernels/moe_reference.py `route` (the same experts, best first; weights within float32
rounding), the whole block against kernels/cpu/moe.py `sorted_moe` on that route (packed Q8_0 and
Q4_K experts, float32 and bfloat16 panels), each token's result not depending on the other tokens of
the call or the thread count (bit for bit), the engine's tally (padding rows not counted), and bad
arguments refused by name. Token counts that are no block multiple; experts no token chose."""
import pytest
import torch

from backend.models.quant_linear import quantize_q8_0
from kernels.cpu import moe as cpu_moe
from kernels.cpu import moe_block
from kernels.cpu import quant as cpu_quant
from kernels.cpu.elementwise import silu_mul
from kernels.moe_reference import route
from test_cpu_quant import packed

E, H, I = 8, 64, 96   # I: no multiple of a 64-column GEMM tile


@pytest.mark.parametrize("experts,top_k", [(8, 1), (8, 2), (32, 4), (60, 8)])
@pytest.mark.parametrize("renormalize", [True, False])
def test_the_route_matches_torchs(experts, top_k, renormalize):
    g = torch.Generator().manual_seed(experts + top_k)
    logits = torch.randn(37, experts, generator=g) * 3
    weights, ids = moe_block.route(logits, top_k, renormalize)
    want_weights, want_ids = route(logits, top_k, renormalize)
    assert ids.dtype == torch.int32 and torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_weights, rtol=4e-6, atol=1e-7)
    if renormalize:
        torch.testing.assert_close(weights.sum(-1), torch.ones(37), rtol=1e-6, atol=1e-6)


def test_ties_go_to_the_lower_expert_and_an_empty_step_is_empty():
    logits = torch.tensor([[0.5, 2.0, 2.0, 2.0, -1.0]])
    assert moe_block.route(logits, 2, True)[1].tolist() == [[1, 2]]
    weights, ids = moe_block.route(torch.empty(0, 5), 2, True)
    assert weights.shape == ids.shape == (0, 2)


def quant_experts(qtype: str, n: int, k: int, seed: int) -> cpu_quant.CpuQuantExperts:
    g = torch.Generator().manual_seed(seed)
    if qtype == "Q8_0":
        return cpu_quant.CpuQuantExperts([cpu_quant.CpuQuantWeight(qtype, quantize_q8_0(
            torch.randn(n, k, generator=g) / 8)) for _ in range(E)])
    return cpu_quant.CpuQuantExperts([cpu_quant.CpuQuantWeight(qtype, packed(qtype, n, k // 256, seed * E + e))
                                      for e in range(E)])


def layouts() -> dict:
    """name -> (gate_up, down, hidden, intermediate): packed experts of two types, float panels of two."""
    g = torch.Generator().manual_seed(7)
    w13, w2 = torch.randn(E, 2 * I, H, generator=g) / 8, torch.randn(E, H, I, generator=g) / 8
    out = {"float32 panels": (cpu_moe.pack_panels(w13), cpu_moe.pack_panels(w2), H, I),
           "bfloat16 panels": (cpu_moe.pack_panels(w13.bfloat16()), cpu_moe.pack_panels(w2.bfloat16()), H, I),
           "Q8_0": (quant_experts("Q8_0", 2 * I, H, 1), quant_experts("Q8_0", H, I, 2), H, I)}
    out["Q4_K"] = (quant_experts("Q4_K", 2 * 256, 256, 3), quant_experts("Q4_K", 256, 256, 4), 256, 256)
    return out


LAYOUTS = layouts()


def reference(gate_up, down, h, logits, top_k, renormalize, intermediate):
    """sorted_moe (torch's sort, gather and index_add_) on the C route's choice."""
    weights, ids = moe_block.route(logits, top_k, renormalize)
    if isinstance(gate_up, torch.Tensor):
        return cpu_moe.grouped_moe(h, gate_up, down, weights, ids, intermediate, silu_mul)
    return cpu_moe.sorted_moe(h, weights, ids, E, gate_up.matmul, down.matmul, silu_mul)


def block_and_inputs(layout: str, tokens: int, top_k: int, renormalize: bool = True, counts=None):
    gate_up, down, hidden, inter = LAYOUTS[layout]
    block = moe_block.CpuMoe(gate_up, down, num_experts=E, hidden=hidden, intermediate=inter, top_k=top_k,
                             renormalize=renormalize, counts=counts)
    g = torch.Generator().manual_seed(tokens * 10 + top_k)
    h = torch.randn(tokens, hidden, generator=g)
    logits = torch.randn(tokens, E, generator=g)
    logits[:, 6] = -1e4   # expert 6: no token's
    return block, h, logits


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("tokens,top_k,renormalize", [(1, 1, True), (13, 2, True), (37, 4, False)])
def test_the_block_matches_sorted_moe(layout, tokens, top_k, renormalize):
    block, h, logits = block_and_inputs(layout, tokens, top_k, renormalize)
    gate_up, down, _, inter = LAYOUTS[layout]
    got = block(h, logits)
    want = reference(gate_up, down, h, logits, top_k, renormalize, inter)
    assert got.shape == want.shape and torch.isfinite(got).all()
    # the same products; the weighted sum's roundings differ (a multiply-add, or a multiply then an
    # add): within a few float32 roundings of the largest output (sums of terms that cancel)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * float(want.abs().max()))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_tokens_result_depends_on_nothing_else_in_the_call(layout):
    """Each token alone, in a batch of 29, and on one thread: the same bits (a step's result does
    not depend on its neighbours or the thread count, so the C stack and the Python block agree)."""
    block, h, logits = block_and_inputs(layout, 29, 2)
    together = block(h, logits)
    alone = torch.cat([block(h[t:t + 1], logits[t:t + 1]) for t in range(29)])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one_thread = block(h, logits)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(together, alone) and torch.equal(together, one_thread)


def test_the_tally_counts_the_real_rows_routing():
    counts = torch.zeros(E, dtype=torch.int64)
    block, h, logits = block_and_inputs("Q8_0", 11, 2, counts=counts)
    valid = torch.tensor([1] * 8 + [0] * 3 + [1] * 5)   # rows 8-10 padding; longer than the call's rows
    block(h, logits, valid)
    ids = route(logits, 2, True)[1][:8].long()
    want = torch.bincount(ids.reshape(-1), minlength=E)
    assert torch.equal(counts, want) and counts[6] == 0 and counts.sum() == 16
    block(h, logits)   # no valid rows given: a step the tally does not count
    assert torch.equal(counts, want)
    block(h, logits, valid)
    assert torch.equal(counts, 2 * want)


def test_bad_arguments_are_refused_by_name():
    gate_up, down, hidden, inter = LAYOUTS["Q8_0"]
    with pytest.raises(ValueError, match=r"top_k = 9; 1 to min\(experts = 8"):
        moe_block.CpuMoe(gate_up, down, num_experts=E, hidden=hidden, intermediate=inter, top_k=9, renormalize=True)
    with pytest.raises(ValueError, match=r"gate_up holds 8 experts \[192, 64\]; expected 8 of \[96, 64\]"):
        moe_block.CpuMoe(gate_up, down, num_experts=E, hidden=hidden, intermediate=48, top_k=2, renormalize=True)
    with pytest.raises(ValueError, match=r"counts must be a contiguous int64 CPU tensor \[8\]"):
        moe_block.CpuMoe(gate_up, down, num_experts=E, hidden=hidden, intermediate=inter, top_k=2,
                         renormalize=True, counts=torch.zeros(7, dtype=torch.int64))
    block, h, logits = block_and_inputs("Q8_0", 5, 2)
    with pytest.raises(ValueError, match=r"logits \(5, 7\); expected \[5, 8\]"):
        block(h, logits[:, :7].contiguous())
    with pytest.raises(ValueError, match=r"h must be a float32 CPU tensor \[T, 64\]"):
        block(h.double(), logits)
    with pytest.raises(ValueError, match=r"valid rows must be a contiguous int64 CPU tensor \[>= 5\]"):
        block(h, logits, torch.ones(4, dtype=torch.int64))
    with pytest.raises(ValueError, match="router logits must be a contiguous float32"):
        moe_block.route(logits.double(), 2, True)
