"""What a decode step's matmuls alone cost and read: the step probe's floor (step_probe.py).

`matmul_floor` runs one step's matmuls through the model's own modules (each layer's qkv and o
projections, its MLP's gate/up and down, or a mixture of experts' router and the GEMMs of the experts
a fixed routing gives the rows, and the lm_head); `step_weights` counts the bytes and weights those matmuls
read, as the model holds them; `gemm_peak_gop_s` is the engine's GEMM at its most efficient.
"""
from __future__ import annotations

import time
from typing import Callable, Optional

import torch

from backend.models.moe import SparseMoeBlock


def matmul_floor(model, batch: int) -> Callable[[], None]:
    """One decode step's matmuls alone: each layer's four projections and the lm_head, B rows,
    through the model's own linear modules (so the floor uses the engine's GEMM: oneDNN's on
    reordered weights on CPU, see backend/models/packed_linear.py). A mixture-of-experts layer's MLP
    is its router and its experts' GEMMs (`expert_matmuls`) on `moe_routing`'s fixed choice."""
    from kernels.dispatch import get_ops
    cfg = model.cfg
    x = torch.randn(batch, cfg.hidden_size)
    attn_out = torch.randn(batch, cfg.num_heads * cfg.head_dim)
    ops = get_ops("auto", x.device, torch.float32)
    mlps = []
    for layer in model.layers:
        mlp = layer.mlp
        if _is_moe(mlp):
            weights, ids = moe_routing(mlp, batch)
            experts = expert_matmuls(mlp.experts, x, ids) or (
                lambda mlp=mlp, weights=weights, ids=ids: mlp.experts(x, weights, ids, ops))
            mlps.append(lambda mlp=mlp, experts=experts: (mlp.gate(x), experts()))
        else:
            act = torch.randn(batch, mlp.down_proj.in_features)
            mlps.append(lambda mlp=mlp, act=act: (mlp.gate_up_proj(x), mlp.down_proj(act)))
    attention = [(layer.self_attn.qkv_proj, layer.self_attn.o_proj) for layer in model.layers]

    @torch.inference_mode()
    def step() -> None:
        for (qkv, o), mlp in zip(attention, mlps):
            qkv(x)
            o(attn_out)
            mlp()
        model.lm_head(x)
    return step


def expert_matmuls(experts, x: torch.Tensor, ids: torch.Tensor) -> Optional[Callable[[], None]]:
    """The experts' GEMMs alone for routing `ids` [B, k]: the rows sorted by expert once, as the
    engine's C call (kernels/cpu/moe_block.py) hands them over, then one call per projection for
    every active expert, on packed experts (CpuQuantExperts) or float panels; None for other
    layouts (one GEMM pair per active expert, the fused kernel), whose floor is the experts' own call."""
    from kernels.cpu import moe as cpu_moe
    _, offsets, tokens = cpu_moe.sort_pairs(ids, experts.num_experts)
    rows = x.index_select(0, tokens).float()
    act = torch.randn(rows.shape[0], experts.intermediate)
    if experts.quant_experts is not None:
        gate_up, down = experts.quant_experts
        return lambda: (gate_up.matmul(rows, offsets), down.matmul(act, offsets))
    if experts.w13_panels is not None:
        inter, hidden = experts.intermediate, x.shape[1]
        return lambda: (cpu_moe.expert_gemm(rows, experts.w13_panels, 2 * inter, offsets),
                        cpu_moe.expert_gemm(act, experts.w2_panels, hidden, offsets))
    return None


def _is_moe(mlp) -> bool:
    return isinstance(mlp, SparseMoeBlock)


def moe_routing(block, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed routing for B rows: row b to experts b k, ..., b k + k - 1 (mod E), equal weights; so
    a step reads min(B k, E) experts, about what random routing reads (the most a step can)."""
    experts, k = block.experts.num_experts, block.top_k
    ids = torch.tensor([[(b * k + i) % experts for i in range(k)] for b in range(batch)], dtype=torch.int32)
    return torch.full((batch, k), 1.0 / k), ids


def _held_bytes(module) -> int:
    """Bytes of weight a linear module reads per call, in the form it holds them."""
    if hasattr(module, "weight_bytes"):  # QuantLinear
        return module.weight_bytes
    if hasattr(module, "parts"):  # ConcatLinear
        return sum(_held_bytes(p) for p in module.parts)
    weight = module.packed if hasattr(module, "packed") else module.weight  # PackedLinear / nn.Linear
    return weight.numel() * weight.element_size()


def _expert_bytes(experts) -> int:
    """Bytes of one expert's gate/up and down projections, as held (per-expert layers, the CPU
    kernel's panels, or the stacked tensors)."""
    if experts.gate_up is not None:
        return _held_bytes(experts.gate_up[0]) + _held_bytes(experts.down[0])
    w13, w2 = (experts.w13_panels, experts.w2_panels) if experts.w13_panels is not None else (experts.w13, experts.w2)
    return (w13.numel() * w13.element_size() + w2.numel() * w2.element_size()) // experts.num_experts


def step_weights(model, batch: int = 1) -> tuple[int, int]:
    """(bytes of weights, number of weights) one decode step's matmuls of `batch` rows read: a
    mixture-of-experts layer's router and the experts `moe_routing` gives those rows."""
    cfg = model.cfg
    modules = [m for layer in model.layers for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj)]
    nbytes = count = 0
    for layer in model.layers:
        mlp = layer.mlp
        if _is_moe(mlp):
            modules.append(mlp.gate)
            active = min(batch * mlp.top_k, mlp.experts.num_experts)
            nbytes += active * _expert_bytes(mlp.experts)
            count += active * 3 * cfg.hidden_size * mlp.experts.intermediate
        else:
            modules += [mlp.gate_up_proj, mlp.down_proj]
    modules.append(model.lm_head)
    count += sum(m.in_features * m.out_features for m in modules)
    assert count > 0 and cfg.num_layers == len(model.layers)
    return nbytes + sum(_held_bytes(m) for m in modules), count


@torch.inference_mode()
def gemm_peak_gop_s(model, rows: int = 256, calls: int = 5) -> float:
    """The engine's GEMM at its most efficient: a dense layer's gate/up projection on `rows` rows (a
    mixture of experts without one: the first layer's qkv projection), the fastest of `calls` (2 x
    weights x rows operations per call)."""
    dense = [layer.mlp.gate_up_proj for layer in model.layers if not _is_moe(layer.mlp)]
    layer = dense[0] if dense else model.layers[0].self_attn.qkv_proj
    x = torch.randn(rows, layer.in_features)
    layer(x)
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        layer(x)
        times.append(time.perf_counter() - t0)
    return 2 * layer.in_features * layer.out_features * rows / min(times) / 1e9
