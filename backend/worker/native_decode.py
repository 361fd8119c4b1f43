"""The CPU engine's steps through one C call for the whole layer stack (issues 37 and 47).

At a small decode batch on the CPU, a step's matmuls were half its time on SmolLM2-135M: the rest
was the Python around ~12 kernel calls a layer (module calls, wrappers' checks, ctypes). The
CPU's answer to CUDA graphs is to leave Python for the whole stack: kernels/cpu/decode_stack.py
runs every layer in C, calling the very kernels the Python layers call, in the same order, so a
step's hidden states are bit for bit those of the Python path (tests/test_native_decode.py), only
sooner (docs/performance.md). A compiled graph (torch.compile's C++ wrapper) was the other way
the issue names; it cannot reach inside the ctypes kernels these layers are made of, so each
would remain a call back into Python.

It covers what the CPU engine runs by default: packed GGUF weights (kernels/cpu/quant.py) and, since
issue 47, float32, bfloat16 and float16 ones (kernels/cpu/float_gemm.py, mixed per tensor) and the
C kernels (attention_backend auto, float32 activations), dense MLPs (Llama, Mistral, Qwen2, Qwen3,
Gemma 3 with its GeGLU, sandwich norms and sliding-window layers), every step: decode rows (empty
and verify rows included) and, since issue 47, prompt chunks (prefill steps, and the mixed steps of
decode rows and a chunk that in-flight batching and prefill pacing make all the time), whose
attention is prefill_attention.c's, the kernel the Python layers' prompt rows run too
(kernels/dispatch.py cpu_ops), so both paths stay bit for bit alike. The input is the step's
embeddings buffer (LlamaForCausalLM.forward's x), so rows whose embeddings are not the token
table's run here as well, once forward has written them into x; a step with an image's rows, whose
attention runs both ways within the image (attention.py, in torch), runs the Python layers. A
mixture-of-experts layer (Mixtral, Qwen3-MoE) runs its router and then kernels/cpu/moe_block.py's C
call, the one the Python block makes. Two things stay Python's, called back from the C loop (ctypes
callbacks on its buffers, so the results stay the Python path's): the MLP of a MoE layer whose
experts that call does not take, and in a step with an adapter's rows the LoRA deltas of each projection
(LoRAStep.add, right after the projection, as lora_project adds them); and a float projection at
the rows where oneDNN is faster than float_gemm.c (backend/models/float_linear.py): the module.
Tensor-parallel ranks on the CPU (issue 47) run their shard of the stack in C as well: the
attention output's and the MLP's partial sums are all-reduced at the points the Python layers'
RowParallel reduces them (after the LoRA deltas, before any norm), by the same means: the group's
shared memory, in C (kernels/cpu/shm_reduce.py: its protocol and sum order, so the bits are the
Python layers'), else the group's all_reduce called back (gloo, a tensor larger than a slot,
INFLIGHT_TP_SHM=python). Every rank's choice is gathered at start and said on rank 0
(`DecodePath.native_ranks`), so a rank that took the Python layers is seen.
Models outside that (float weights on oneDNN: INFLIGHT_FLOAT_GEMM=onednn, a width not a multiple of
32) run the Python layers; the log says which models and why, once.
INFLIGHT_NATIVE_DECODE=0 turns it off (the A/B of the benchmarks).
"""
from __future__ import annotations

import functools
import logging
import os
from typing import Optional

import torch

from backend.models.attention import AttentionContext
from backend.models.float_linear import FloatLinear
from backend.models.llama import MLP, LlamaForCausalLM
from backend.models.moe import SparseMoeBlock
from backend.models.parallel.layers import RowParallel
from backend.models.quant_linear import ConcatLinear, QuantLinear
from backend.models.rope import RopeTables

log = logging.getLogger(__name__)


def _projection(module) -> Optional[object]:
    """A projection's matrices as the C loop takes them (kernels/cpu/decode_stack.py Projection),
    or None where it is not made of them: a QuantLinear on the C kernel, a FloatLinear (float32,
    bfloat16 or float16 weights: kernels/cpu/float_gemm.py), or a ConcatLinear of such parts
    (llama.cpp's mixed types) whose bias, if any, is added after. Where a FloatLinear runs oneDNN
    from some rows on, the stack calls the whole module back for steps of that many rows."""
    from kernels.cpu.decode_stack import Projection
    if isinstance(module, RowParallel):  # a rank's shard: the stack all-reduces its partial sums
        module = module.inner
    concat = isinstance(module, ConcatLinear)
    parts = list(module.parts) if concat else [module]
    if not all(isinstance(p, FloatLinear) or (isinstance(p, QuantLinear) and p.kernel is not None) for p in parts):
        return None
    if concat and any(p.bias is not None for p in parts):
        return None
    bias = module.float_bias() if isinstance(module, FloatLinear) else \
        None if module.bias is None else module.bias.detach().float()
    onednn_from = [p.onednn_from for p in parts if isinstance(p, FloatLinear) and p.onednn_from]
    return Projection([p.kernel for p in parts], bias, caller=module if onednn_from else None,
                      caller_from=min(onednn_from, default=0))


def unsupported(model: LlamaForCausalLM, ops_name: str, tp) -> Optional[str]:
    """Why this model's decode steps cannot run in C, or None when they can (LoRA or not: a step's
    adapter deltas are called back)."""
    cfg = model.cfg
    if os.environ.get("INFLIGHT_NATIVE_DECODE", "1") == "0":
        return "INFLIGHT_NATIVE_DECODE=0"
    if ops_name != "cpu":
        return f"the kernels are {ops_name}'s, not the CPU's C kernels"
    if cfg.activation not in ("silu", "gelu_tanh"):
        return f"{cfg.activation} MLPs"
    for i, layer in enumerate(model.layers):
        mlp = _unwrapped(layer.mlp)
        if not isinstance(mlp, (MLP, SparseMoeBlock)):
            return f"layer {i}'s MLP is a {type(mlp).__name__}"
        dense = (mlp.gate_up_proj, mlp.down_proj) if isinstance(mlp, MLP) else ()
        for module in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, *dense):
            if _projection(module) is None:
                return f"layer {i} has {type(_unwrapped(module)).__name__} weights, not ones the C kernels take"
    return None


def _unwrapped(mlp):
    """A layer's MLP block or projection, unwrapped where a tensor-parallel rank sums it (the stack's sum)."""
    return mlp.inner if isinstance(mlp, RowParallel) else mlp


class NativeDecode:
    """The model's layers as a kernels.cpu.decode_stack.DecodeStack, remade when the KV caches or
    the RoPE tables it points into are replaced. `tp`: this rank's group (the stack all-reduces)."""

    def __init__(self, model: LlamaForCausalLM, tp=None):
        self.model, self.tp = model, tp
        self._stack, self._made_for = None, None
        self._said = False  # the log line on steps with images, once
        self._tally = None  # the engine's ExpertLoad, where the stack's MoE layers add to it
        self.shm, self.reduction = None, ""  # a rank's C all-reduce (ShmReduce) and the log's words for it
        if tp is not None:
            self.shm, self.reduction = _c_all_reduce(tp)
            self._counted = (0, 0.0)  # the C all-reduces already added to the group's stats

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext,
                 rope: RopeTables) -> torch.Tensor:
        """The hidden states after the final norm (LlamaForCausalLM.forward's result)."""
        if getattr(ctx, "image_spans", None):  # images' bidirectional runs: attention.py's torch pass
            return self._python_layers(x, positions, ctx, rope)
        caches = ctx.kv_caches
        key = (id(caches), caches[0][0].data_ptr(), id(rope), ctx.scale, ctx.layer_windows, ctx.layer_groups)
        if key != self._made_for:
            self._stack, self._made_for = self._make(ctx, rope), key
        prompt = None if ctx.num_decode_tokens == x.shape[0] else (ctx.prefill_cu_seqlens_q.contiguous(),
                                                                   ctx.prefill_block_tables.contiguous(),
                                                                   ctx.prefill_seq_lens.contiguous())
        tally = self._tally
        out = self._stack(x, positions.contiguous(), ctx.slot_mapping.contiguous(),
                          ctx.decode_block_tables.contiguous(), ctx.decode_seq_lens.contiguous(), ctx.lora, prompt,
                          expert_valid=None if tally is None or tally.skip else tally.valid)
        if self.shm is not None:  # the group's stats count every all-reduce, C's too
            calls, seconds = self.shm.stats()
            self.tp.count("all_reduce", calls - self._counted[0], seconds - self._counted[1])
            self._counted = (calls, seconds)
        return out

    def _python_layers(self, x, positions, ctx: AttentionContext, rope: RopeTables) -> torch.Tensor:
        """A step the C loop does not take, through the Python layers (as forward's own loop)."""
        if not self._said:
            self._said = True
            log.info("steps with an image's placeholder rows: the Python layers (their attention within "
                     "each image runs both ways, in torch); the other steps: the C layer stack")
        residual = None
        for layer in self.model.layers:
            x, residual = layer(x, residual, positions, ctx, rope)
        return ctx.ops.rms_norm(x, self.model.norm.weight, self.model.norm.eps, residual)[0]

    def _make(self, ctx: AttentionContext, rope: RopeTables):
        from kernels.cpu.decode_stack import DecodeStack, StackLayer
        cfg, layers = self.model.cfg, []
        for i, layer in enumerate(self.model.layers):
            attn, mlp = layer.self_attn, _unwrapped(layer.mlp)
            cos, sin = rope.for_layer(attn.window)  # as the Python layer picks its table
            k_cache, v_cache = ctx.kv_caches[i]
            dense = isinstance(mlp, MLP)
            moe = None if dense else mlp.cpu_moe()   # the route and the experts in C (moe_block.c)
            router = None if moe is None else _projection(mlp.gate)
            moe = None if router is None else moe
            if moe is not None and mlp.load is not None:
                self._tally = mlp.load
            layers.append(StackLayer(
                qkv=_projection(attn.qkv_proj), o=_projection(attn.o_proj),
                gate_up=_projection(mlp.gate_up_proj) if dense else None,
                down=_projection(mlp.down_proj) if dense else None,
                router=router, moe=moe,
                # other experts: the block itself, as DecoderLayer calls it (the stack passes lora)
                mlp=None if dense or moe is not None else functools.partial(mlp, ops=ctx.ops, layer=attn.layer),
                input_norm=layer.input_layernorm.weight.detach(),
                post_attn_norm=layer.post_attention_layernorm.weight.detach(), k_cache=k_cache, v_cache=v_cache,
                cos=cos, sin=sin, q_norm=None if attn.q_norm is None else attn.q_norm.weight.detach(),
                k_norm=None if attn.k_norm is None else attn.k_norm.weight.detach(),
                pre_ff_norm=layer.pre_feedforward_layernorm.weight.detach() if layer.sandwich else None,
                post_ff_norm=layer.post_feedforward_layernorm.weight.detach() if layer.sandwich else None,
                group=ctx.group_of(i), window=ctx.window_of(i)))
        return DecodeStack(layers, final_norm=self.model.norm.weight.detach(), heads=cfg.num_heads,
                           kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, eps=cfg.rms_norm_eps,
                           scale=ctx.scale, activation=cfg.activation,
                           all_reduce=None if self.tp is None else self.tp.all_reduce, shm=self.shm)


def _c_all_reduce(tp) -> tuple[Optional[object], str]:
    """A tensor-parallel rank's all-reduce in C (kernels/cpu/shm_reduce.py's ShmReduce on the group's
    shared memory), or None and the group's all_reduce is called back; and the log's words for it."""
    from kernels.cpu.build import CpuKernelUnavailable
    if tp.shm is None:
        return None, "the group's all-reduce (gloo), called back"
    if os.environ.get("INFLIGHT_TP_SHM") == "python":
        return None, "the group's shared memory, its Python side called back (INFLIGHT_TP_SHM=python)"
    try:
        return tp.shm.native(), "the group's shared memory, in C"
    except CpuKernelUnavailable as exc:
        return None, f"the group's shared memory, its Python side called back ({exc})"


def native_ranks(tp, native: Optional[NativeDecode]) -> list[bool]:
    """Which tensor-parallel ranks run the C stack (every rank calls this at start: a collective);
    rank 0 says so, and names any rank that took the Python layers (that rank's log says why)."""
    ranks = [bool(r) for r in tp.gather_ints(int(native is not None))]
    python = [r for r, on in enumerate(ranks) if not on]
    if tp.rank == 0 and any(ranks) and python:
        log.warning("tensor-parallel ranks %s run the Python layers, the others the C layer stack", python)
    elif tp.rank == 0 and any(ranks):
        log.info("the C layer stack on every tensor-parallel rank (%d), all-reducing through %s", tp.size,
                 native.reduction)
    return ranks
