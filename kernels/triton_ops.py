"""The Triton kernels under the reference names and signatures (see kernels/reference.py).

kernels.dispatch imports this module lazily; importing it imports triton.
"""
from kernels.activation import gelu_tanh_mul, silu_mul
from kernels.decode_attention import decode_attention
from kernels.fused_moe import fused_moe
from kernels.norm import rms_norm
from kernels.prefill_attention import prefill_attention
from kernels.rope import rotary_embedding
from kernels.store_kv import store_kv

__all__ = ["store_kv", "decode_attention", "prefill_attention", "rms_norm", "rotary_embedding", "silu_mul",
           "gelu_tanh_mul", "fused_moe"]
