"""What kernels.aot compiles: every launch an engine step of a model makes, planned by each
wrapper's own `plan_*` function with engine-like CPU tensors (the layouts and index dtypes of
backend/worker/runner.py and backend/models/llama.py), at several step shapes, in a dtype, with the LoRA
and fp8-KV-cache variants, and what a model's architecture adds: the q/k norm of each head (Qwen3,
Gemma 3), GeGLU and float32 norm weights (Gemma's 1 + w), and the sliding-window attention of its
local layers beside the full attention of its global ones. Import it through kernels.aot, which
makes sure the kernels are real @triton.jit functions (not the interpreter's) before this module
imports them.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch

from kernels.gpu import decode_attention as decode_mod
from kernels.gpu.activation import plan_gated_activation
from kernels.gpu.fused_moe import moe_blocks, plan_fused_moe
from kernels.gpu.launch import Launch
from kernels.lora_reference import Segments
from kernels.gpu.lora_sgmv import plan_lora_expand, plan_lora_shrink
from kernels.moe_reference import max_padded_pairs
from kernels.gpu.norm import plan_rms_norm
from kernels.gpu.prefill_attention import plan_prefill_attention
from kernels.gpu.quant_dispatch import aot_launches as quant_launches
from kernels.gpu.quant_w8_gemm import FP8_MIN_ARCH
from kernels.gpu.rope import plan_rotary_embedding
from kernels.gpu.store_kv import plan_store_kv


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    qkv_bias: bool = False
    qk_norm: bool = False        # RMSNorm of each head of q and k (Qwen3, Gemma 3)
    activation: str = "silu"     # the gated MLP's: silu, or gelu_tanh (Gemma's GeGLU)
    float32_norms: bool = False  # norm weights kept in float32 (Gemma's 1 + w, backend/models/llama.py)
    window: int = 0              # the local layers' sliding window (0: every layer global)
    # mixture of experts (0: a dense MLP): experts, experts per token, an expert's intermediate size
    experts: int = 0
    top_k: int = 0
    expert_intermediate: int = 0


# The config.json fields of the public checkpoints on the Hugging Face Hub (hidden_size,
# num_attention_heads, num_key_value_heads, head_dim = hidden_size / num_attention_heads unless the
# config says, intermediate_size, sliding_window):
GEMMA3 = dict(qk_norm=True, activation="gelu_tanh", float32_norms=True)
MODELS = {
    "Llama-3.1-8B": ModelShape(4096, 32, 8, 128, 14336),    # meta-llama/Llama-3.1-8B
    "Llama-3.2-1B": ModelShape(2048, 32, 8, 64, 8192),      # meta-llama/Llama-3.2-1B
    "Qwen2-7B": ModelShape(3584, 28, 4, 128, 18944, True),  # Qwen/Qwen2-7B
    "Mistral-7B": ModelShape(4096, 32, 8, 128, 14336),      # mistralai/Mistral-7B-v0.1
    "Qwen3-8B": ModelShape(4096, 32, 8, 128, 12288, qk_norm=True),             # Qwen/Qwen3-8B
    "Gemma-3-4B": ModelShape(2560, 8, 4, 256, 10240, window=1024, **GEMMA3),   # google/gemma-3-4b-it
    "Gemma-3-270M": ModelShape(640, 4, 1, 256, 2048, window=512, **GEMMA3),    # google/gemma-3-270m
    # mixtures of experts (num_local_experts / num_experts, num_experts_per_tok, and Qwen3's
    # moe_intermediate_size; Mixtral's experts are intermediate_size wide)
    "Mixtral-8x7B": ModelShape(4096, 32, 8, 128, 14336, experts=8, top_k=2, expert_intermediate=14336),
    "Qwen3-30B-A3B": ModelShape(2048, 32, 4, 128, 6144, qk_norm=True, experts=128, top_k=8,
                                expert_intermediate=768),
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DEFAULT_BLOCK_SIZE = 16   # EngineConfig.kv_block_size's default


# Step shapes the launches are planned at: (tokens, decode sequences, block-table width). The
# integers that change from step to step are not specialized by the kernels, so every shape lands
# on the same compiled variants: the sweep shows it (the rows are deduplicated by variant).
STEP_SHAPES = ((6, 2, 3), (1, 1, 1), (48, 16, 64), (256, 256, 2048))


def model_launches(shape: ModelShape, dtype: torch.dtype, block_size: int = DEFAULT_BLOCK_SIZE) -> list[Launch]:
    """Every launch an engine step of this model makes, with the engine's argument layouts (q and k
    strided views of the fused qkv projection, v contiguous, index tensors int32, slots and
    positions int64), at each of STEP_SHAPES and, for decode attention, every split count."""
    launches: list[Launch] = []
    for tokens, seqs, width in STEP_SHAPES:
        launches += _step_launches(shape, dtype, block_size, tokens, seqs, width)
    # the quantized GEMMs of the four projections (their variants do not depend on the step shape)
    h, g, d = shape.heads, shape.kv_heads, shape.head_dim
    mlp = shape.expert_intermediate or shape.intermediate   # packed experts: one GEMM per expert
    launches += quant_launches({"qkv": ((h + 2 * g) * d, shape.hidden, shape.qkv_bias), "o": (shape.hidden, h * d, False),
                                "gate_up": (2 * mlp, shape.hidden, False),
                                "down": (shape.hidden, mlp, False)}, dtype)
    launches += lora_launches(shape, dtype)
    if shape.experts:
        launches += moe_launches(shape, dtype)
    return launches


# Tokens a MoE step is planned at: the step shapes' and a prefill chunk, which between them take
# both tile configurations of kernels/gpu/fused_moe.py on every model.
MOE_TOKENS = sorted({tokens for tokens, _, _ in STEP_SHAPES} | {2048})


def moe_launches(shape: ModelShape, dtype: torch.dtype) -> list[Launch]:
    """The fused-MoE gate/up and down launches at each of MOE_TOKENS, with the layouts of
    backend/models/moe.py (stacked expert weights, float32 routing weights, int32 sorted pairs)."""
    e, k, inter, hidden = shape.experts, shape.top_k, shape.expert_intermediate, shape.hidden
    w13 = torch.empty(e, 2 * inter, hidden, dtype=dtype)   # never touched: only its layout is read
    w2 = torch.empty(e, hidden, inter, dtype=dtype)
    launches = []
    for tokens in MOE_TOKENS:
        pairs = tokens * k
        block_m = moe_blocks(pairs, e).block_m
        rows = max_padded_pairs(pairs, e, block_m)
        launches += plan_fused_moe(
            torch.zeros(tokens, hidden, dtype=dtype), w13, w2, torch.zeros(tokens, k, dtype=torch.float32),
            torch.zeros(rows, dtype=torch.int32), torch.zeros(rows // block_m, dtype=torch.int32),
            torch.zeros(1, dtype=torch.int32), torch.empty(pairs, inter, dtype=dtype),
            torch.empty(pairs, hidden, dtype=dtype), k)
    return launches


# LoRA (backend/lora/): the slot ranks compiled (max_lora_rank padded to a power of two >= 16), and
# the segments of a step (the kernels read them from the device; only the grid changes with them).
LORA_RANKS = (16, 64)
LORA_SLOTS = 4


def lora_launches(shape: ModelShape, dtype: torch.dtype) -> list[Launch]:
    """The segmented shrink and expand of each fused projection, as backend/worker/lora/step.py launches
    them: the banks of LORA_SLOTS slots, x and out in the model's dtype, y float32."""
    h, g, d, hidden, inter = shape.heads, shape.kv_heads, shape.head_dim, shape.hidden, shape.intermediate
    projections = {"qkv": (hidden, (0, h * d, (h + g) * d, (h + 2 * g) * d)), "o": (h * d, (0, hidden)),
                   "gate_up": (hidden, (0, inter, 2 * inter)), "down": (inter, (0, hidden))}
    if shape.experts:   # adapters reach the attention of a MoE model, not its experts
        del projections["gate_up"], projections["down"]
    launches = []
    for rank in LORA_RANKS:
        for tokens in (1, 48):
            table = torch.zeros(3, 2 * LORA_SLOTS, dtype=torch.int32)
            segments = Segments([], table[0], table[1], table[2], tokens)
            for fan_in, bounds in projections.values():
                shards = len(bounds) - 1
                x = torch.zeros(tokens, fan_in, dtype=dtype)
                out = torch.zeros(tokens, bounds[-1], dtype=dtype)
                a_bank = torch.zeros(LORA_SLOTS, shards * rank, fan_in, dtype=dtype)
                b_bank = torch.zeros(LORA_SLOTS, bounds[-1], rank, dtype=dtype)
                y = torch.zeros(tokens, shards * rank, dtype=torch.float32)
                launches += [plan_lora_shrink(x, a_bank, y, segments), plan_lora_expand(y, b_bank, bounds, segments, out)]
    return launches


# kv_cache_dtype=fp8 (sm_89+): the launches that touch the cache, again with an e4m3 cache beside
# bf16/fp16 activations; a column of their own in the table ("bf16+kv-fp8")
KV_FP8 = "+kv-fp8"


def kv_fp8_launches(shape: ModelShape, dtype: torch.dtype, block_size: int = DEFAULT_BLOCK_SIZE) -> list[Launch]:
    """The cache's store and the two attentions with an fp8 cache, at each of STEP_SHAPES."""
    fp8 = torch.float8_e4m3fn
    return [replace(launch, min_arch=FP8_MIN_ARCH)
            for tokens, seqs, width in STEP_SHAPES
            for launch in _step_launches(shape, dtype, block_size, tokens, seqs, width, kv_dtype=fp8)
            if any(isinstance(a, torch.Tensor) and a.dtype == fp8 for a in launch.args)]


def dtype_variants(shape: ModelShape, dtype_name: str, block_size: int) -> list[tuple[str, list[Launch]]]:
    """(column label, launches): the dtype's own, and for bf16/fp16 its fp8-cache launches."""
    dtype = DTYPES[dtype_name]
    variants = [(dtype_name, model_launches(shape, dtype, block_size))]
    if dtype != torch.float32:
        variants.append((dtype_name + KV_FP8, kv_fp8_launches(shape, dtype, block_size)))
    return variants


def _step_launches(shape: ModelShape, dtype: torch.dtype, block_size: int, tokens: int, seqs: int,
                   table_width: int, kv_dtype: Optional[torch.dtype] = None) -> list[Launch]:
    h, g, d = shape.heads, shape.kv_heads, shape.head_dim
    qkv = torch.zeros(tokens, (h + 2 * g) * d, dtype=dtype)
    q, k, v = qkv.split((h * d, g * d, g * d), dim=-1)
    q, k, v = q.view(tokens, h, d), k.view(tokens, g, d), v.reshape(tokens, g, d).contiguous()
    k_cache = torch.zeros(4, block_size, g, d, dtype=kv_dtype or dtype)   # the values are never read: any blocks do
    v_cache = torch.zeros_like(k_cache)
    tables = torch.zeros(max(seqs, 2), table_width, dtype=torch.int32)
    seq_lens = torch.ones(max(seqs, 2), dtype=torch.int32)
    cos = torch.zeros(64, d // 2, dtype=torch.float32)
    positions = torch.zeros(tokens, dtype=torch.int64)
    q_rot, k_rot = torch.empty(tokens, h, d, dtype=dtype), torch.empty(tokens, g, d, dtype=dtype)
    x = torch.zeros(tokens, shape.hidden, dtype=dtype)
    norm_dtype = torch.float32 if shape.float32_norms else dtype
    weight = torch.ones(shape.hidden, dtype=norm_dtype)
    gate_up = torch.zeros(tokens, 2 * shape.intermediate, dtype=dtype)
    scale = d ** -0.5
    prefill_seqs = 2 if tokens > 1 else 1
    cu = torch.tensor([0, tokens // 2, tokens][-prefill_seqs - 1:], dtype=torch.int32)

    launches = [
        plan_rms_norm(x, weight, 1e-5, None, torch.empty_like(x), x),                     # first layer
        plan_rms_norm(x, weight, 1e-5, x.clone(), torch.empty_like(x), torch.empty_like(x)),
        plan_rotary_embedding(q, k, positions, cos, cos.clone(), q_rot, k_rot),
        *(plan_store_kv(k_rot, v, k_cache, v_cache, slots) for slots in _alignments(
            torch.zeros(tokens, dtype=torch.int64), shape)),
        plan_gated_activation(gate_up, torch.empty(tokens, shape.intermediate, dtype=dtype), shape.activation),
    ]
    if shape.qk_norm:  # each head of q and of k, as rows of head_dim (backend/models/llama.py's head_norm)
        head_weight = torch.ones(d, dtype=norm_dtype)
        for rows in (q_rot.reshape(-1, d), k_rot.reshape(-1, d)):
            launches.append(plan_rms_norm(rows, head_weight, 1e-6, None, torch.empty_like(rows), rows))
    windows = (0, shape.window) if shape.window else (0,)  # global layers, then local ones
    for window, prefill_tables in ((w, t) for w in windows for t in _alignments(tables[:prefill_seqs], shape)):
        launches.append(plan_prefill_attention(q_rot, k_cache, v_cache, prefill_tables, cu,
                                               seq_lens[:prefill_seqs], scale, torch.empty_like(q_rot), tokens,
                                               window=window, on_gpu=True))
    n = min(seqs, tokens)
    decode_q = q_rot[:n]
    for window, decode_tables in ((w, t) for w in windows for t in _alignments(tables[:n], shape)):
        for num_splits in range(1, decode_mod.MAX_SPLITS + 1):
            launches += decode_mod.plan_decode_attention(decode_q, k_cache, v_cache, decode_tables, seq_lens[:n],
                                                         scale, torch.empty_like(decode_q), num_splits,
                                                         decode_mod.DEFAULT_BLOCK_N, window)
    return launches


def _alignments(index: torch.Tensor, shape: ModelShape) -> list[torch.Tensor]:
    """`index` (slots, block tables) as the engine passes it: a model with two KV groups (a sliding
    window) takes each group's rows from one [groups, ...] tensor (backend/models/attention.py), so the
    second group's pointer is 16-byte aligned only when the first's rows happen to fill 16 bytes:
    Triton compiles a variant for each, and both are planned."""
    if not shape.window:
        return [index]
    shifted = torch.zeros(index.numel() + 1, dtype=index.dtype)[1:].view(index.shape)
    return [index, shifted]
