"""The mixture-of-experts MLP block of Mixtral and Qwen3-MoE (docs/design.md, "Mixture of experts").

A router (`gate`, a [E, H] linear layer) scores the experts of each token; the top K, weighted by
their softmax probabilities (renormalized over the K for Mixtral, and for Qwen3-MoE when
`norm_topk_prob`), each run the token through their gated MLP, and the weighted outputs add up.

The experts are stored stacked, as the fused-MoE kernel reads them: w13 [E, 2I, H] (each expert's
gate rows then its up rows, fused as the dense MLP's gate_up_proj) and w2 [E, H, I]. On the CPU
(`pack_experts`) float experts become the C kernel's panels (`Experts.to_panels`), or one
oneDNN-packed layer per expert where that serves better (bf16 on AMX); packed GGUF experts stay as
an import keeps them (`install_packed_experts`, one QuantLinear each) and int8 quantizes them
(`quantize_experts`), both also gathered into one int8 C call per projection (`quant_experts`).
The block's forward is the same either way: `ops.fused_moe` (kernels/dispatch.py) on stacked
tensors; with the CPU's kernels, on panels and packed experts, everything after the router in one C
call (kernels/cpu/moe_block.py: route, sort, one GEMM call per projection for every active expert,
weighted sum, tally; the C layer stack makes the same call); with the torch references,
kernels/cpu/moe.py `sorted_moe` on those (its oracle); kernels/moe_reference.py's grouped path on
other per-expert layers: only the experts that have tokens run (docs/design.md, "Mixture of experts").

Checkpoint names: Mixtral's `block_sparse_moe.{gate, experts.N.w1/w3/w2}`, Qwen3-MoE's
`mlp.{gate, experts.N.gate_proj/up_proj/down_proj}`; an imported GGUF's packed experts arrive
stacked, without the N (backend/models/gguf/mapping.py).
"""
from __future__ import annotations

import re
from typing import Callable, Iterable, Optional

import torch
from torch import nn

from backend.models.loader import ModelConfig
from backend.models.weight_shapes import checkpoint_name  # noqa: F401  (weights.py reads it here)
from kernels.cpu import moe as cpu_moe
from kernels.cpu import moe_block as cpu_moe_block
from kernels.moe_reference import grouped_moe, route

# expert weight -> (stacked parameter, shard of w13: 0 gate, 1 up; None: w2)
EXPERT_PARTS = {"w1": ("w13", 0), "gate_proj": ("w13", 0), "w3": ("w13", 1), "up_proj": ("w13", 1),
                "w2": ("w2", None), "down_proj": ("w2", None)}
_PARTS = "|".join(EXPERT_PARTS)
_EXPERT = re.compile(rf"^(?P<layer>layers\.\d+)\.mlp\.experts\.(?P<expert>\d+)\.(?P<part>{_PARTS})\.weight$")
STACKED = re.compile(rf"^(?:model\.)?(?P<layer>layers\.\d+)\.(?:block_sparse_moe|mlp)\.experts\.(?P<part>{_PARTS})$")


class Experts(nn.Module):
    def __init__(self, num_experts: int, hidden: int, intermediate: int):
        super().__init__()
        self.num_experts, self.hidden, self.intermediate = num_experts, hidden, intermediate
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, intermediate), requires_grad=False)
        # one layer per expert, once they replace w13 and w2
        self.gate_up: Optional[nn.ModuleList] = None
        self.down: Optional[nn.ModuleList] = None
        # or w13 and w2 in the CPU kernel's panels (kernels/cpu/moe.py), once they replace them
        self.register_buffer("w13_panels", None, persistent=False)
        self.register_buffer("w2_panels", None, persistent=False)
        # per-expert layers that are all the int8 C kernel's, of one type: also as one call each
        self.quant_experts = None

    def forward(self, h: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, ops) -> torch.Tensor:
        if self.w13_panels is not None:   # the CPU: one C call per projection for every active expert
            return cpu_moe.grouped_moe(h, self.w13_panels, self.w2_panels, weights, ids, self.intermediate,
                                       ops.silu_mul)
        if self.quant_experts is not None:   # packed experts on the CPU: one int8 C call per projection
            gate_up, down = self.quant_experts
            return cpu_moe.sorted_moe(h, weights, ids, self.num_experts, gate_up.matmul, down.matmul, ops.silu_mul)
        if self.gate_up is not None:   # reads each expert's count on the host: one GEMM pair per active expert
            return grouped_moe(h, self.gate_up, self.down, weights, ids)
        return ops.fused_moe(h, self.w13, self.w2, weights, ids)

    def to_panels(self) -> None:
        """Replace the stacked float weights by the CPU kernel's layout of them (the only copy)."""
        w13, w2 = cpu_moe.pack_panels(self.w13), cpu_moe.pack_panels(self.w2)
        del self.w13, self.w2
        self.w13_panels, self.w2_panels = w13, w2

    def per_expert_layers(self, gate_up: Iterable[nn.Module], down: Iterable[nn.Module]) -> None:
        """Replace the stacked weights by one layer per expert (each w13[e] / w2[e] as a linear)."""
        self.gate_up, self.down = nn.ModuleList(gate_up), nn.ModuleList(down)
        if len(self.gate_up) != self.num_experts or len(self.down) != self.num_experts:
            raise ValueError(f"experts: {len(self.gate_up)} gate/up and {len(self.down)} down layers for "
                             f"{self.num_experts} experts")
        del self.w13, self.w2
        self.quant_experts = quant_experts(self.gate_up, self.down)

    def extra_repr(self) -> str:
        kind = ("CPU panels" if self.w13_panels is not None else "stacked" if self.gate_up is None
                else f"per expert ({type(self.gate_up[0]).__name__}"
                + (", one C call per projection)" if self.quant_experts is not None else ")"))
        return f"experts={self.num_experts}, intermediate={self.intermediate}, {kind}"


class SparseMoeBlock(nn.Module):
    """The MLP of a mixture-of-experts layer; called like the dense MLP (backend/models/llama.py).
    LoRA adapters do not reach the experts (backend/models/lora/peft_format.py refuses them)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.top_k, self.renormalize = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)

    def forward(self, h: torch.Tensor, ops, lora=None, layer: int = 0) -> torch.Tensor:
        logits = self.gate(h)
        native = self.cpu_moe() if ops.name == "cpu" else None
        if native is not None:   # the CPU's kernels: the route, the experts and the tally in one C call
            return native(h, logits, self.tally_rows())
        weights, ids = route(logits, self.top_k, self.renormalize)
        if self.load is not None:
            self.load.record(self.load_row, ids)
        return self.experts(h, weights, ids, ops)

    load = None   # the engine's tally of tokens per expert (backend/models/expert_load.py)
    load_row = 0
    _cpu, _cpu_made_for = None, None

    def cpu_moe(self) -> Optional[cpu_moe_block.CpuMoe]:
        """The block after its router as one C call (kernels/cpu/moe_block.py) on the experts'
        layout of now (panels, or packed experts of one type), adding to the engine's tally; None
        for other layouts. The C layer stack calls the same (backend/worker/native_decode.py), so
        both give the same bits."""
        made_for = (self.experts.w13_panels, self.experts.quant_experts, self.load)
        if self._cpu_made_for is None or any(a is not b for a, b in zip(made_for, self._cpu_made_for)):
            counts = None if self.load is None or self.load.counts.is_cuda else self.load.counts[self.load_row]
            self._cpu = cpu_moe_block.CpuMoe.of(self.experts, self.top_k, self.renormalize, counts)
            self._cpu_made_for = made_for
        return self._cpu

    def tally_rows(self) -> Optional[torch.Tensor]:
        """The step's rows the engine's tally counts (ExpertLoad.valid), or None: none to count."""
        return None if self.load is None or self.load.skip else self.load.valid


def quant_experts(gate_up: nn.ModuleList, down: nn.ModuleList) -> Optional[tuple]:
    """Packed per-expert layers (QuantLinear on the C kernel) as kernels/cpu/quant.py
    CpuQuantExperts, (gate/up, down); None where any layer is something else (a ConcatLinear of
    mixed types, the torch reference where no compiler exists, a float layer) or the types differ:
    those run one GEMM pair per active expert."""
    from backend.models.quant_linear import QuantLinear
    from kernels.cpu.quant import CpuQuantExperts
    layers = [*gate_up, *down]
    if not all(isinstance(m, QuantLinear) and m.kernel is not None and m.bias is None for m in layers):
        return None
    if len({m.qtype for m in gate_up}) > 1 or len({m.qtype for m in down}) > 1:
        return None
    return CpuQuantExperts([m.kernel for m in gate_up]), CpuQuantExperts([m.kernel for m in down])


def moe_blocks(model: nn.Module) -> list[SparseMoeBlock]:
    return [m for m in model.modules() if isinstance(m, SparseMoeBlock)]


def reads_counts_on_host(model: nn.Module) -> bool:
    """Whether the model's experts run grouped per expert, reading each expert's token count on
    the host (per-expert layers: packed or int8 experts; the CPU's panels), which a CUDA graph
    cannot capture."""
    return any(b.experts.gate_up is not None or b.experts.w13_panels is not None for b in moe_blocks(model))


class ExpertLoader:
    """Copies a checkpoint's per-expert weights into the stacked parameters and says when each
    stacked parameter has all of them (every expert's gate and up, or down)."""

    def __init__(self, params: dict[str, nn.Parameter]):
        self.params = params
        self.pieces: dict[str, set] = {}

    def take(self, name: str, tensor: torch.Tensor) -> bool:
        """Load `name` (``model.`` removed, checkpoint_name applied) if it is an expert weight."""
        match = _EXPERT.match(name)
        if match is None:
            return False
        stacked, shard = EXPERT_PARTS[match["part"]]
        target = f"{match['layer']}.mlp.experts.{stacked}"
        if target not in self.params:
            raise ValueError(f"checkpoint has an unexpected weight '{name}' (layer {match['layer']} has no experts)")
        param, expert = self.params[target], int(match["expert"])
        rows = param.shape[1] // 2 if shard is not None else param.shape[1]
        if expert >= param.shape[0] or tuple(tensor.shape) != (rows, param.shape[2]):
            raise ValueError(f"weight '{name}' has shape {tuple(tensor.shape)}; expected ({rows}, {param.shape[2]}) "
                             f"of one of {param.shape[0]} experts")
        offset = (shard or 0) * rows
        param.data[expert, offset:offset + rows].copy_(tensor)
        self.pieces.setdefault(target, set()).add((expert, shard))
        return True

    def complete(self) -> set[str]:
        """The stacked parameters every piece of which arrived."""
        done = set()
        for target, pieces in self.pieces.items():
            param = self.params[target]
            shards = (0, 1) if target.endswith("w13") else (None,)
            if pieces == {(e, s) for e in range(param.shape[0]) for s in shards}:
                done.add(target)
        return done


def onednn_linear(weight: torch.Tensor) -> nn.Module:
    """A weight matrix [N, K] (an expert's slice) as a oneDNN-packed linear layer (no bias)."""
    from backend.models.packed_linear import PackedLinear
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    linear.weight = nn.Parameter(weight, requires_grad=False)
    return PackedLinear(linear)


def pack_experts(model: nn.Module, make_linear: Optional[Callable[[torch.Tensor], nn.Module]] = None) -> int:
    """Each MoE block's stacked float experts laid out for the CPU; returns the blocks done. By
    default in the C kernel's panels (`Experts.to_panels`: every active expert in one call per
    projection), or oneDNN-packed per expert where the kernel cannot be built or is the slower
    (`cpu_moe.panels_serve`: bfloat16 where oneDNN runs AMX); with `make_linear` one layer per
    expert, `make_linear(weight [N, K])` (int8: Q8_0 QuantLinears; the old float path,
    `onednn_linear`, for client/tools/benchmarks/moe.py)."""
    blocks = [b for b in moe_blocks(model) if b.experts.gate_up is None and b.experts.w13_panels is None]
    if blocks and make_linear is None and cpu_moe.panels_serve(blocks[0].experts.w13.dtype) and cpu_moe.available():
        for block in blocks:
            block.experts.to_panels()
        return len(blocks)
    make_linear = make_linear or onednn_linear
    for block in blocks:
        ex = block.experts
        ex.per_expert_layers([make_linear(ex.w13[e].detach()) for e in range(ex.num_experts)],
                             [make_linear(ex.w2[e].detach()) for e in range(ex.num_experts)])
    return len(blocks)


def _stacked_parts(name: str) -> Optional[tuple[str, int]]:
    """A stacked packed expert module (``model.layers.N.mlp.experts.gate_proj``, Mixtral's
    ``block_sparse_moe.experts.w1``) -> (its layer, 0 gate / 1 up / 2 down); None for others."""
    match = STACKED.match(name)
    if match is None:
        return None
    stacked, shard = EXPERT_PARTS[match["part"]]
    return match["layer"], 2 if shard is None else shard


def is_stacked_expert(name: str) -> bool:
    return _stacked_parts(name) is not None


def unstacked(name: str, stacked: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """A stacked expert module's float weight [E, N, K] as the per-expert tensors a checkpoint
    names (``...experts.{e}.{part}.weight``), for the loader."""
    base, _, part = name.rpartition(".")
    return [(f"{base}.{e}.{part}.weight", stacked[e]) for e in range(stacked.shape[0])]


def install_packed_experts(model: nn.Module, packed: dict[str, tuple[str, dict[str, torch.Tensor]]]) -> None:
    """Packed GGUF experts, stacked [E, ...] as an import keeps them ({module: (qtype, arrays)}),
    as one QuantLinear per expert: gate and up fused into one GEMM (two where their types differ,
    as llama.cpp's mixes have it), down its own."""
    from backend.models.quant_linear import ConcatLinear, QuantLinear, concat_parts

    layers: dict[str, list] = {}
    for name, item in packed.items():
        layer, part = _stacked_parts(name)
        layers.setdefault(layer, [None, None, None])[part] = item
    for layer, (gate, up, down) in layers.items():
        if gate is None or up is None or down is None:
            raise ValueError(f"packed checkpoint: {layer}'s experts lack their gate, up or down projection")
        experts = model.get_submodule(f"{layer}.mlp.experts")
        count = gate[1]["qweight"].shape[0]

        def one(item, e):
            return item[0], {k: v[e] for k, v in item[1].items()}

        def gate_up(e):
            (gt, ga), (ut, ua) = one(gate, e), one(up, e)
            if gt == ut:
                return QuantLinear(gt, concat_parts([ga, ua]))
            return ConcatLinear([QuantLinear(gt, ga), QuantLinear(ut, ua)])

        experts.per_expert_layers([gate_up(e) for e in range(count)],
                                  [QuantLinear(*one(down, e)) for e in range(count)])


def quantize_experts(model: nn.Module, quantize: Callable[[torch.Tensor], nn.Module]) -> bool:
    """quantization=int8: every stacked expert one Q8_0 QuantLinear (`quantize(weight)`), when its
    inputs are whole groups of 32; False when they are not (the experts stay float)."""
    blocks = moe_blocks(model)
    if blocks and (model.cfg.hidden_size % 32 or blocks[0].experts.intermediate % 32):
        return False
    pack_experts(model, quantize)
    return True


def dequantized_experts(name: str, qtype: str, arrays: dict[str, torch.Tensor], dtype: torch.dtype,
                        dequantize: Callable) -> list[tuple[str, torch.Tensor]]:
    """quantization=none on a packed checkpoint: a stacked packed expert module [E, N, ...] as each
    expert's float weight, under the checkpoint's per-expert names."""
    flat = {k: v.flatten(0, 1) for k, v in arrays.items()}   # [E * N, ...]: one matrix of E * N rows
    return unstacked(name, dequantize(qtype, flat).to(dtype).unflatten(0, arrays["qweight"].shape[:2]))
