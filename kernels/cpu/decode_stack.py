"""A step's layer stack in one C call (kernels/cpu/csrc/decode_stack.c), for the CPU engine.

`DecodeStack(layers, ...)` takes every layer's weights (packed: kernels/cpu/quant.py; float32,
bfloat16 or float16: kernels/cpu/float_gemm.py; mixed per tensor), norms, KV caches and RoPE
tables once, checks them, and lays them out as the C structs; a call then runs all the layers for
one step's rows: decode rows, and prompt chunks after them (issue 47). The C loop calls the
kernels the Python path calls (each matrix's GEMM of the build chosen for this CPU, elementwise.c,
decode_attention.c, prefill_attention.c) in the same order, so its oracle is that path, bit for
bit (tests/test_native_decode.py).

Every check the per-kernel wrappers make once a step (index bounds of the positions, slots, block
tables and lengths) is made here once a step; the C code checks nothing.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from kernels import checks as _common

from kernels.cpu import build as cpu_build

from kernels.cpu import decode_attention as cpu_decode_attention
from kernels.cpu import prefill_attention as cpu_prefill_attention
from kernels.cpu import float_gemm as cpu_float_gemm
from kernels.cpu import quant as cpu_quant

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
MAX_PARTS = 4  # decode_stack.c's: a fused projection of up to four differently typed parts
CACHE_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}


class _Proj(ctypes.Structure):
    _fields_ = [("gemm", _P * MAX_PARTS), ("w", _P * MAX_PARTS), ("col", _I * MAX_PARTS), ("parts", _I), ("N", _I),
                ("bias", _P), ("caller_from", _I)]


class _Layer(ctypes.Structure):
    _fields_ = [("qkv", _Proj), ("o", _Proj), ("gate_up", _Proj), ("down", _Proj),
                ("input_norm", _P), ("post_attn_norm", _P), ("pre_ff_norm", _P), ("post_ff_norm", _P),
                ("q_norm", _P), ("k_norm", _P),
                ("k_cache", _P), ("v_cache", _P), ("cos", _P), ("sin", _P), ("group", _I), ("window", _I),
                ("router", _Proj), ("moe", _P)]


class _Dims(ctypes.Structure):
    _fields_ = [("hidden", _I), ("heads", _I), ("kv_heads", _I), ("head_dim", _I), ("intermediate", _I),
                ("block_size", _I), ("table_width", _I), ("eps", _F), ("scale", _F), ("moe_valid", _P)]


class _Ops(ctypes.Structure):
    _fields_ = [(name, _P) for name in ("rms_norm", "rotary", "store_kv", "attention", "act_mul", "mlp",
                                        "delta", "prefill", "project", "reduce", "shm_reduce", "shm", "moe",
                                        "moe_scratch")]


class _Prompt(ctypes.Structure):  # decode_stack.c's prompt_rows_t
    _fields_ = [("seqs", _I), ("table_width", _I), ("cu_seqlens_q", _P), ("tables", _P), ("seq_lens", _P)]


# decode_stack.c's mlp_fn (layer, h, T, out), delta_fn and project_fn (layer, which, x, T, out): 0, or nonzero
# if the caller's MLP, LoRA deltas or projection failed
_MLP_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p)
_DELTA_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                             ctypes.c_void_p)
_REDUCE_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_int64)  # reduce_fn (x, n)
PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")  # decode_stack.c's QKV, O, GATE_UP, DOWN
STACK_PROJECTIONS = ("qkv", "o", "gate_up", "down", "router")  # StackLayer's, by decode_stack.c's index


@dataclass
class Projection:
    """A fused projection: one matrix, packed (CpuQuantWeight) or float (CpuFloatWeight), or several
    side by side (ConcatLinear's parts). With `caller` (x [T, K] -> [T, N]: the module's own
    forward, oneDNN's GEMM), steps of `caller_from` rows or more call it back instead (0: never)."""
    parts: Sequence[object]
    bias: Optional[torch.Tensor] = None
    caller: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
    caller_from: int = 0


@dataclass
class StackLayer:
    qkv: Projection
    o: Projection
    gate_up: Optional[Projection]  # [gate | up], the activation·mul between it and down
    down: Optional[Projection]
    input_norm: torch.Tensor
    post_attn_norm: torch.Tensor
    k_cache: torch.Tensor  # [NB, BS, G, D] float32 or bfloat16
    v_cache: torch.Tensor
    cos: torch.Tensor  # this layer's RoPE table [max_pos, D/2]
    sin: torch.Tensor
    q_norm: Optional[torch.Tensor] = None  # per-head norms (Qwen3, Gemma 3)
    k_norm: Optional[torch.Tensor] = None
    pre_ff_norm: Optional[torch.Tensor] = None  # Gemma's sandwich norms around the MLP
    post_ff_norm: Optional[torch.Tensor] = None
    group: int = 0  # its KV-cache group (the row of slots and tables it reads)
    window: int = 0  # its sliding window, 0: full attention
    # A mixture of experts in place of gate_up and down: its router [E, hidden] and kernels/cpu/moe_block.py
    # CpuMoe (the route and the experts in C); or, for experts that takes not, the Python block itself,
    # (h [T, hidden], lora) -> [T, hidden], called back from the C loop
    router: Optional[Projection] = None
    moe: Optional[object] = None
    mlp: Optional[Callable[..., torch.Tensor]] = None


def _rows(address: int, t: int, width: int) -> torch.Tensor:
    """The C loop's buffer at `address` as a float32 [t, width] tensor, in place."""
    return torch.frombuffer((ctypes.c_float * (t * width)).from_address(address), dtype=torch.float32).view(t, width)


def _f32(name: str, t: torch.Tensor, shape: tuple) -> int:
    if t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous() or tuple(t.shape) != shape:
        raise ValueError(f"decode_stack: {name} must be a contiguous float32 CPU tensor {list(shape)}; got "
                         f"{t.dtype} {tuple(t.shape)} on {t.device}")
    return t.data_ptr()


class DecodeStack:
    def __init__(self, layers: Sequence[StackLayer], *, final_norm: torch.Tensor, heads: int, kv_heads: int,
                 head_dim: int, eps: float, scale: float, activation: str = "silu",
                 all_reduce: Optional[Callable[[torch.Tensor], torch.Tensor]] = None, shm=None):
        """final_norm: the model's norm after the last layer [hidden]; activation: "silu" or
        "gelu_tanh" (GeGLU), the MLP's, as elementwise.c computes it. A tensor-parallel rank's
        shard: `all_reduce` (its group's, in place) sums the attention output's and the MLP's
        partial outputs, or `shm` (kernels/cpu/shm_reduce.py's ShmReduce) in C where it can."""
        if not layers:
            raise ValueError("decode_stack: no layers")
        first = layers[0]
        dense = [layer for layer in layers if layer.mlp is None and layer.moe is None]
        moe = [layer.moe for layer in layers if layer.moe is not None]
        self.experts = moe[0].num_experts if moe else 0
        self.hidden = first.input_norm.shape[0]
        self.intermediate = dense[0].down.parts[0].in_features if dense else 0
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        nb, bs, g, d = first.k_cache.shape
        if (g, d) != (kv_heads, head_dim) or heads % kv_heads:
            raise ValueError(f"decode_stack: caches [.., {g}, {d}] against {heads} heads, "
                             f"{kv_heads} kv heads of {head_dim}")
        self.cache_dtype, self.num_blocks, self.block_size = first.k_cache.dtype, nb, bs
        if self.cache_dtype not in CACHE_SUFFIX:
            raise ValueError(f"decode_stack: caches must be float32 or bfloat16; got {self.cache_dtype}")
        self.max_pos = first.cos.shape[0]
        self.groups = 1 + max(layer.group for layer in layers)
        q_size, kv_size = heads * head_dim, kv_heads * head_dim
        widths = {"qkv": (self.hidden, q_size + 2 * kv_size), "o": (q_size, self.hidden),
                  "gate_up": (self.hidden, 2 * self.intermediate), "down": (self.intermediate, self.hidden),
                  "router": (self.hidden, self.experts)}
        # each part's own build (kernels/cpu/quant.py's or float_gemm.py's): what the log and benches say
        self.isas = sorted({f"{type(w).__name__} {w.isa}" for layer in layers for name in widths
                            if getattr(layer, name) is not None for w in getattr(layer, name).parts})
        self._keep = list(layers)  # the tensors the structs point into
        self._layers = (_Layer * len(layers))()
        for i, (layer, out) in enumerate(zip(layers, self._layers)):
            kinds = (layer.gate_up is not None and layer.down is not None, layer.mlp is not None,
                     layer.moe is not None and layer.router is not None)
            if sum(kinds) != 1 or (layer.moe is None) != (layer.router is None):
                raise ValueError(f"decode_stack: layer {i} needs gate_up and down, a router and a moe, or an mlp: one")
            if layer.moe is not None:
                if (layer.moe.num_experts, layer.moe.hidden) != (self.experts, self.hidden):
                    raise ValueError(f"decode_stack: layer {i}'s experts are {layer.moe.num_experts} of hidden "
                                     f"{layer.moe.hidden}; the first MoE layer's {self.experts} of {self.hidden}")
                out.moe = ctypes.addressof(layer.moe.struct)
            for name, (k, n) in widths.items():
                if getattr(layer, name) is not None:  # a caller's MLP leaves gate_up.parts 0
                    self._projection(f"layer {i} {name}", getattr(layer, name), k, n, getattr(out, name))
            out.input_norm = _f32(f"layer {i} input_norm", layer.input_norm, (self.hidden,))
            out.post_attn_norm = _f32(f"layer {i} post_attn_norm", layer.post_attn_norm, (self.hidden,))
            if (layer.q_norm is None) != (layer.k_norm is None):
                raise ValueError(f"decode_stack: layer {i} has one of q_norm and k_norm")
            if layer.q_norm is not None:
                out.q_norm = _f32(f"layer {i} q_norm", layer.q_norm, (head_dim,))
                out.k_norm = _f32(f"layer {i} k_norm", layer.k_norm, (head_dim,))
            if (layer.pre_ff_norm is None) != (layer.post_ff_norm is None):
                raise ValueError(f"decode_stack: layer {i} has one of pre_ff_norm and post_ff_norm")
            if layer.pre_ff_norm is not None:
                out.pre_ff_norm = _f32(f"layer {i} pre_ff_norm", layer.pre_ff_norm, (self.hidden,))
                out.post_ff_norm = _f32(f"layer {i} post_ff_norm", layer.post_ff_norm, (self.hidden,))
            for name in ("k_cache", "v_cache"):
                t = getattr(layer, name)
                if t.dtype != self.cache_dtype or tuple(t.shape) != (nb, bs, g, d) or not t.is_contiguous():
                    raise ValueError(f"decode_stack: layer {i} {name} must be a contiguous {self.cache_dtype} "
                                     f"{[nb, bs, g, d]}; got {t.dtype} {tuple(t.shape)}")
                setattr(out, name, t.data_ptr())
            out.cos = _f32(f"layer {i} cos", layer.cos, (self.max_pos, head_dim // 2))
            out.sin = _f32(f"layer {i} sin", layer.sin, (self.max_pos, head_dim // 2))
            if layer.window < 0 or layer.group < 0:
                raise ValueError(f"decode_stack: layer {i} window {layer.window}, group {layer.group}")
            out.group, out.window = layer.group, layer.window
        self.final_norm = final_norm
        _f32("final_norm", final_norm, (self.hidden,))
        self.eps, self.scale = float(eps), float(scale)
        _common.check_paged_attention("decode_stack", torch.empty(0, heads, head_dim), "[S, H, D]",
                                      first.k_cache, first.v_cache, torch.empty(0, 1, dtype=torch.int32),
                                      torch.empty(0, dtype=torch.int32), scale, cache_dtype_may_differ=True)
        if activation not in ("silu", "gelu_tanh"):
            raise ValueError(f"decode_stack: activation must be silu or gelu_tanh; got {activation!r}")
        suffix = CACHE_SUFFIX[self.cache_dtype]
        self._ops = _Ops(cpu_build.address(cpu_build.load("elementwise").rms_norm_f32),
                         cpu_build.address(cpu_build.load("elementwise").rotary_f32),
                         cpu_build.address(cpu_build.load("elementwise")[f"store_kv_{suffix}"]),
                         cpu_build.address(cpu_build.load(cpu_decode_attention.NAME)[f"decode_attention_{suffix}"]),
                         cpu_build.address(cpu_build.load("elementwise")[f"{activation}_mul_f32"]), None, None,
                         cpu_build.address(cpu_prefill_attention.kernel_for(self.cache_dtype)))
        self._failure: Optional[BaseException] = None
        self._lora = None  # the step's backend.worker.lora.step.LoRAStep, while a call with one runs
        # kept on self: C calls them as long as the stack lives
        self._mlp_callback, self._delta_callback = _MLP_FN(self._caller_mlp), _DELTA_FN(self._lora_deltas)
        if any(layer.mlp is not None for layer in layers):
            self._ops.mlp = cpu_build.address(self._mlp_callback)
        if moe:
            from kernels.cpu import moe_block
            self._ops.moe = cpu_build.address(cpu_build.load(moe_block.NAME).moe_block)
            self._ops.moe_scratch = cpu_build.address(cpu_build.load(moe_block.NAME).moe_scratch_bytes)
        self._delta_address = cpu_build.address(self._delta_callback)
        self._project_callback = _DELTA_FN(self._caller_projection)  # project_fn: delta_fn's signature
        self._ops.project = cpu_build.address(self._project_callback)
        self._all_reduce, self._reduce_callback = all_reduce, _REDUCE_FN(self._caller_reduce)
        if all_reduce is not None:
            self._ops.reduce = cpu_build.address(self._reduce_callback)
            if shm is not None:
                self._ops.shm_reduce, self._ops.shm, self._shm = shm.function, shm.address, shm
        self._shapes = tuple(widths.values())  # (K, N) by decode_stack.c's QKV, O, GATE_UP, DOWN, ROUTER
        self._run = cpu_build.function("decode_stack", "decode_stack",
                                       (_P, _P, _P, _I, _I, _P, _P, _P, _P, _P, _P, _P, _I, _P), restype=ctypes.c_int)
        self._dims = _Dims(self.hidden, heads, kv_heads, head_dim, self.intermediate, bs, 0, self.eps, self.scale)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, tables: torch.Tensor,
                 seq_lens: torch.Tensor, lora=None, prompt=None, expert_valid=None) -> torch.Tensor:
        """Every layer on a step's T rows: x [T, hidden] float32 (the embeddings), positions [T]
        int64, slots [groups, T] int64 (-1: not stored); its ND decode rows first, tables [groups,
        ND, MB] int32, seq_lens [ND] int32 (the row's own token included; 0: an empty row); then,
        with `prompt` = (cu_seqlens_q [P + 1], tables [groups, P, MB'], seq_lens [P]) as
        AttentionContext's prefill_* hold them, P prompt chunks in the other T - ND rows -> the
        hidden states [T, hidden] after the final norm, as the model's forward returns them.
        `lora`: the step's LoRAStep when a row has an adapter; its deltas are added after each
        projection, as lora_project does. `expert_valid`: the rows the experts' tally counts
        (ExpertLoad.valid, int64 [>= T]), or None: not this step."""
        t = x.shape[0]
        nd = seq_lens.shape[0] if seq_lens.dim() == 1 else -1
        _f32("x", x, (t, self.hidden))
        for name, v, dtype, shape in (("positions", positions, torch.int64, (t,)),
                                      ("slots", slots, torch.int64, (self.groups, t)),
                                      ("seq_lens", seq_lens, torch.int32, (t if prompt is None else nd,))):
            if v.dtype != dtype or tuple(v.shape) != shape or not v.is_contiguous() or not 0 <= nd <= t:
                raise ValueError(f"decode_stack: {name} must be contiguous {dtype} {list(shape)}; got "
                                 f"{v.dtype} {tuple(v.shape)}")
        if tables.dtype != torch.int32 or tables.dim() != 3 or tuple(tables.shape[:2]) != (self.groups, nd) \
                or not tables.is_contiguous():
            raise ValueError(f"decode_stack: tables must be contiguous int32 [{self.groups}, {nd}, MB]; got "
                             f"{tables.dtype} {tuple(tables.shape)}")
        width = tables.shape[2]
        check = _common.bounds_checked.once
        check("stack_positions", positions, 0, self.max_pos, "decode_stack: positions")
        check("stack_slots", slots, -1, self.num_blocks * self.block_size, "decode_stack: slots")
        check("stack_seq_lens", seq_lens, 0, width * self.block_size + 1,
              f"decode_stack: seq_lens (the tables hold {width} blocks of {self.block_size})")
        check("stack_tables", tables, 0, self.num_blocks, "decode_stack: block ids")
        rows = None
        if prompt is not None:
            cu, p_tables, p_lens = prompt
            if p_tables.dim() != 3 or p_tables.shape[0] != self.groups:
                raise ValueError(f"decode_stack: the prompt rows' tables must be [{self.groups}, P, MB]; "
                                 f"got {tuple(p_tables.shape)}")
            cpu_prefill_attention.check_chunks("decode_stack (the prompt rows)", "stack_prompt", cu, p_lens, p_tables,
                                               t - nd, self.num_blocks, self.block_size)
            rows = _Prompt(p_lens.shape[0], p_tables.shape[2], cu.data_ptr(), p_tables.data_ptr(), p_lens.data_ptr())
        from kernels.cpu.moe_block import check_valid
        check_valid("decode_stack: expert_valid", expert_valid, t)
        self._dims.moe_valid = None if expert_valid is None or not self.experts else expert_valid.data_ptr()
        x = x.clone()  # the stack's running activations
        out = torch.empty_like(x)
        self._dims.table_width = width
        self._lora, self._ops.delta = lora, None if lora is None else self._delta_address
        status = t and self._run(ctypes.byref(self._ops), ctypes.byref(self._dims), self._layers, len(self._keep),
                                 t, positions.data_ptr(), slots.data_ptr(), tables.data_ptr(), seq_lens.data_ptr(),
                                 x.data_ptr(), self.final_norm.data_ptr(), out.data_ptr(), nd,
                                 None if rows is None else ctypes.byref(rows))
        self._lora = None
        if status == -2:
            failure, self._failure = self._failure, None
            raise failure
        if status:
            raise MemoryError(f"decode_stack: no memory for the scratch of {t} rows")
        return out

    def _caller_mlp(self, layer: int, h: int, t: int, out: int) -> int:
        """decode_stack.c's mlp_fn: layer `layer`'s own MLP on the C loop's buffers, viewed in place.
        An exception cannot cross the C frames: it is kept, and __call__ raises it once C returns."""
        try:
            _rows(out, t, self.hidden).copy_(self._keep[layer].mlp(_rows(h, t, self.hidden), lora=self._lora))
            return 0
        except BaseException as exc:  # noqa: BLE001 (raised again in __call__)
            self._failure = exc
            return 1

    def _lora_deltas(self, layer: int, which: int, x: int, t: int, out: int) -> int:
        """decode_stack.c's delta_fn: the step's adapter deltas of one projection, added to its
        output in place (LoRAStep.add, as backend/worker/lora/step.py's lora_project adds them)."""
        try:
            k, n = self._shapes[which]
            y = _rows(out, t, n)
            added = self._lora.add(y, _rows(x, t, k), layer, PROJECTIONS[which])
            if added.data_ptr() != y.data_ptr():
                y.copy_(added)
            return 0
        except BaseException as exc:  # noqa: BLE001 (raised again in __call__)
            self._failure = exc
            return 1

    def _caller_projection(self, layer: int, which: int, x: int, t: int, out: int) -> int:
        """decode_stack.c's project_fn: a projection's own forward (Projection.caller) on the C
        loop's buffers, for the steps whose rows it is faster at."""
        try:
            k, n = self._shapes[which]
            proj = getattr(self._keep[layer], STACK_PROJECTIONS[which])
            _rows(out, t, n).copy_(proj.caller(_rows(x, t, k)))
            return 0
        except BaseException as exc:  # noqa: BLE001 (raised again in __call__)
            self._failure = exc
            return 1

    def _caller_reduce(self, x: int, n: int) -> int:
        """decode_stack.c's reduce_fn: the group's all-reduce of a [T, hidden] buffer, in place."""
        try:
            self._all_reduce(_rows(x, n // self.hidden, self.hidden))
            return 0
        except BaseException as exc:  # noqa: BLE001 (raised again in __call__)
            self._failure = exc
            return 1

    def _projection(self, what: str, p: Projection, k: int, n: int, out: _Proj) -> None:
        if not 1 <= len(p.parts) <= MAX_PARTS:
            raise ValueError(f"decode_stack: {what} has {len(p.parts)} parts; 1 to {MAX_PARTS}")
        col = 0
        for i, w in enumerate(p.parts):
            if isinstance(w, cpu_quant.CpuQuantWeight):
                library, gemm = cpu_quant.NAME, "qgemm"
            elif isinstance(w, cpu_float_gemm.CpuFloatWeight):
                library, gemm = cpu_float_gemm.NAME, "fgemm"
            else:
                raise ValueError(f"decode_stack: {what} part {i} must be a packed or float matrix; got {type(w).__name__}")
            if w.in_features != k:
                raise ValueError(f"decode_stack: {what} part {i} has {w.in_features} inputs; expected {k}")
            out.gemm[i] = cpu_build.address(cpu_build.load(library, w.isa)[gemm])
            out.w[i], out.col[i] = ctypes.addressof(w._struct), col
            col += w.out_features
        if col != n:
            raise ValueError(f"decode_stack: {what} has {col} outputs; expected {n}")
        if p.caller_from < 0 or (p.caller_from and p.caller is None):
            raise ValueError(f"decode_stack: {what} calls back from {p.caller_from} rows with no caller")
        out.parts, out.N, out.caller_from = len(p.parts), n, p.caller_from
        out.bias = None if p.bias is None else _f32(f"{what} bias", p.bias, (n,))
