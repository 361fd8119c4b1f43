"""The decoder of every architecture inflight serves (Llama 2/3/3.1, Mistral, Qwen2, Qwen3, Gemma 3;
the mixtures of experts Mixtral and Qwen3-MoE), over a flat batch with no padding.

Differences between them are configuration (backend/models/loader.py's ModelConfig), not code: Qwen2 has
q/k/v biases and often tied embeddings; Llama 3 adds llama3 rope scaling; Mistral slides a window
over every layer; Qwen3 RMS-normalizes each head of q and k before RoPE (`qk_norm`), with a head_dim
apart from hidden / heads; Gemma 3 adds to that local sliding-window layers between global ones,
each kind with its own RoPE base, GeGLU (tanh-GELU) for SiLU, embeddings scaled by sqrt(hidden),
norms on the attention's and the MLP's outputs too (`sandwich_norms`), RMSNorm weights applied as
(1 + w) (folded into the weights at load), query_pre_attn_scalar as the attention scale, and an
optional final logit soft-cap. Mixtral and Qwen3-MoE (Qwen3's attention) replace some or all layers'
MLP by a mixture of experts (`make_mlp`, backend/models/moe.py). q/k/v and gate/up projections are
fused into one matmul each.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from backend.models.attention import AttentionContext
from backend.models.loader import ModelConfig
from backend.models.lora.project import LoRADeltas, lora_project
from backend.models.moe import ExpertLoader, SparseMoeBlock
from backend.models.rope import RopeTables
from backend.models.weight_shapes import decoder_name
from kernels.dispatch import KernelOps


class RMSNormWeight(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.window = cfg.window(layer)  # its RoPE table follows (the attention's mask: ctx)
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.split = (q_size, kv_size, kv_size)
        self.qkv_proj = nn.Linear(cfg.hidden_size, q_size + 2 * kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(q_size, cfg.hidden_size, bias=cfg.o_bias)
        # one weight of head_dim shared by every head: whole on every tensor-parallel rank
        self.q_norm = RMSNormWeight(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNormWeight(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(self, h: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext,
                rope: RopeTables) -> torch.Tensor:
        t = h.shape[0]
        q, k, v = lora_project(ctx.lora, self.layer, "qkv_proj", self.qkv_proj, h).split(self.split, dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = head_norm(ctx.ops, q, self.q_norm), head_norm(ctx.ops, k, self.k_norm)
        cos, sin = rope.for_layer(self.window)
        q, k = ctx.ops.rotary_embedding(q, k, positions, cos, sin)
        out = ctx.attend(self.layer, q, k, v.contiguous()).reshape(t, -1)
        return lora_project(ctx.lora, self.layer, "o_proj", self.o_proj, out)


def head_norm(ops: KernelOps, x: torch.Tensor, norm: RMSNormWeight) -> torch.Tensor:
    """RMSNorm of every head of x [T, heads, head_dim] (Qwen3's and Gemma 3's q/k norm): the
    norm kernel over [T * heads, head_dim] rows."""
    t, heads, dim = x.shape
    return ops.rms_norm(x.reshape(t * heads, dim), norm.weight, norm.eps)[0].view(t, heads, dim)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.activation = f"{cfg.activation}_mul"  # the KernelOps entry: silu_mul or gelu_tanh_mul

    def forward(self, h: torch.Tensor, ops: KernelOps, lora: Optional[LoRADeltas] = None, layer: int = 0) -> torch.Tensor:
        act = getattr(ops, self.activation)(lora_project(lora, layer, "gate_up_proj", self.gate_up_proj, h))
        return lora_project(lora, layer, "down_proj", self.down_proj, act)


def make_mlp(cfg: ModelConfig, layer: int) -> nn.Module:
    """The layer's MLP: dense, or a mixture of experts (Mixtral, Qwen3-MoE: backend/models/moe.py)."""
    return SparseMoeBlock(cfg) if cfg.is_moe_layer(layer) else MLP(cfg)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.self_attn = Attention(cfg, layer)
        self.mlp = make_mlp(cfg, layer)
        self.input_layernorm = RMSNormWeight(cfg.hidden_size, cfg.rms_norm_eps)
        # Llama: the MLP's input norm. Gemma: the attention output's norm, then a pre- and a
        # post-feedforward norm around the MLP (HF's names, so the weights load by name).
        self.post_attention_layernorm = RMSNormWeight(cfg.hidden_size, cfg.rms_norm_eps)
        self.sandwich = cfg.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNormWeight(cfg.hidden_size, cfg.rms_norm_eps)
            self.post_feedforward_layernorm = RMSNormWeight(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, residual, positions, ctx: AttentionContext, rope: RopeTables):
        """(x, residual) -> (x', residual'): the layer's output is x' + residual' (the residual add
        is fused into the next norm)."""
        ops = ctx.ops
        h, residual = _norm(ops, x, self.input_layernorm, residual)
        h = self.self_attn(h, positions, ctx, rope)
        if self.sandwich:
            h, _ = _norm(ops, h, self.post_attention_layernorm)
            h, residual = _norm(ops, h, self.pre_feedforward_layernorm, residual)
            h = self.mlp(h, ops, ctx.lora, self.self_attn.layer)
            return _norm(ops, h, self.post_feedforward_layernorm)[0], residual
        h, residual = _norm(ops, h, self.post_attention_layernorm, residual)
        return self.mlp(h, ops, ctx.lora, self.self_attn.layer), residual


def _norm(ops: KernelOps, x: torch.Tensor, norm: RMSNormWeight, residual: Optional[torch.Tensor] = None):
    return ops.rms_norm(x, norm.weight, norm.eps, residual)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        # its weight given, so no random init runs: on the meta device (load_model) that init imports
        # torch._dynamo, ~1.5 s of every process that loads a model (each tensor-parallel worker)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNormWeight(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        # a cross-encoder's score head (*ForSequenceClassification; pooling: backend/worker/pooler.py)
        self.score = nn.Linear(cfg.hidden_size, cfg.num_labels, bias=False) if cfg.head == "score" else None
        # The activations' dtype when it is not the weights' (CPU: float32 beside bf16 or packed
        # weights, backend/models/weights.py); None: the embedding's.
        self.compute_dtype: torch.dtype | None = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext,
                rope: RopeTables, decode_stack=None) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm. `decode_stack`: the layers as one call,
        (x, positions, ctx, rope) -> the normed hidden states, which the worker passes for a decode
        step when it chose the CPU's C stack (backend/worker/fast_paths.py). The context's `mm_embeds`
        (images: backend/worker/vision.py) replace their rows' token embeddings, unscaled, as
        transformers' Gemma 3 merges them."""
        x = self.embed_tokens(input_ids)
        if self.cfg.embedding_scale != 1.0:
            # as HF's Gemma: sqrt(hidden) rounded to the embedding's dtype (25.25 for 640 in bf16)
            x = x * float(torch.tensor(self.cfg.embedding_scale, dtype=x.dtype))
        if self.compute_dtype is not None and x.dtype != self.compute_dtype:
            x = x.to(self.compute_dtype)
        if ctx.mm_embeds is not None:
            x = x.index_copy(0, ctx.mm_embeds[0], ctx.mm_embeds[1].to(x.dtype))
        if decode_stack is not None:
            return decode_stack(x, positions, ctx, rope)  # every layer and the final norm in C
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, positions, ctx, rope)
        h, _ = _norm(ctx.ops, x, self.norm, residual)
        return h

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        cap = self.cfg.final_logit_softcapping
        return logits if not cap else torch.tanh(logits / cap) * cap

    # -- weights --------------------------------------------------------------------------------
    # Fused parameter -> the HF tensors it concatenates, in order (vLLM's packed_modules_mapping).
    # Each is loaded once into its slice (shard_sizes); tensor parallelism will cut at the same
    # boundaries, so they stay explicit rather than implied by a plain concatenation.
    packed_modules_mapping = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    _FUSED = {hf: (fused, shard) for fused, hfs in packed_modules_mapping.items() for shard, hf in enumerate(hfs)}

    def shard_sizes(self, fused: str) -> tuple[int, ...]:
        """Output rows of each shard of a fused projection: (q, k, v) or (gate, up)."""
        if fused == "qkv_proj":
            return self.layers[0].self_attn.split
        return (self.cfg.intermediate_size,) * 2

    def load_weights(self, weights) -> None:
        """Copy HF-named tensors in, fusing q/k/v and gate/up; fail on missing or unknown names."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        experts = ExpertLoader(params)  # per-expert tensors into the stacked [E, ...] parameters
        for hf_name, tensor in weights:
            name = decoder_name(hf_name)  # (the vision tower of a multimodal Gemma 3 skipped: "")
            if not name:
                continue
            if experts.take(name, tensor):
                continue
            parts = name.split(".")
            fused = next((p for p in parts if p in self._FUSED), None)
            if fused is None:
                self._copy(params, name, tensor, None, loaded)
                continue
            target, shard = self._FUSED[fused]
            name = name.replace(fused, target)
            self._copy(params, name, tensor, shard, loaded)
        # (a quantized lm_head, tied or not, is set up before loading: backend/models/weights.py)
        if "lm_head.weight" in params and (self.cfg.tie_word_embeddings or "lm_head.weight" not in loaded):
            self.lm_head.weight = self.embed_tokens.weight
            loaded.add("lm_head.weight")
        if self.score is not None and "score.weight" not in loaded and self.cfg.classifier_token_ids:
            no, yes = self.cfg.classifier_token_ids  # vLLM's classifier_from_token: sigmoid(yes - no) = P(yes)
            self.score.weight.data.copy_((self.lm_head.weight[yes] - self.lm_head.weight[no]).unsqueeze(0))
            loaded.add("score.weight")
        loaded |= experts.complete()
        for name in list(loaded):  # a fused weight counts once all of its shards arrived
            if "#" in name:
                base = name.split("#")[0]
                shards = len(self.packed_modules_mapping[base.split(".")[-2]])
                if all(f"{base}#{i}" in loaded for i in range(shards)):
                    loaded.add(base)
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing weights: {missing[:8]}{' ...' if len(missing) > 8 else ''}")

    def _copy(self, params, name, tensor, shard, loaded) -> None:
        if name not in params:
            raise ValueError(f"checkpoint has an unexpected weight '{name}'")
        param = params[name]
        if shard is None:
            if param.shape != tensor.shape:
                raise ValueError(f"weight '{name}' has shape {tuple(tensor.shape)}; expected {tuple(param.shape)}")
            if self.cfg.norm_weight_offset and name.endswith("norm.weight"):
                # Gemma's (1 + w), folded in once and kept in float32 as HF computes it (bf16 would
                # round 1 + w to 8 bits); the norm kernels take a float32 weight beside any activations
                param.data = tensor.to(param.device, torch.float32) + self.cfg.norm_weight_offset
            else:
                param.data.copy_(tensor)
            loaded.add(name)
            return
        sizes = self.shard_sizes(name.split(".")[-2])
        offset = sum(sizes[:shard])
        expected = (sizes[shard],) + tuple(param.shape[1:])
        if tuple(tensor.shape) != expected:
            raise ValueError(f"weight for '{name}' shard {shard} has shape {tuple(tensor.shape)}; expected {expected}")
        param.data[offset:offset + sizes[shard]].copy_(tensor)
        loaded.add(f"{name}#{shard}")
