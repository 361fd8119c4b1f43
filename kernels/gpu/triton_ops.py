"""The Triton kernels under the reference names and signatures (see kernels/reference.py).

kernels.dispatch imports this module lazily; importing it imports triton.
"""
from kernels.gpu.activation import gelu_tanh_mul, silu_mul
from kernels.gpu.decode_attention import decode_attention
from kernels.gpu.fused_moe import fused_moe
from kernels.gpu.norm import rms_norm
from kernels.gpu.prefill_attention import prefill_attention
from kernels.gpu.rope import rotary_embedding
from kernels.gpu.store_kv import store_kv

__all__ = ["store_kv", "decode_attention", "prefill_attention", "rms_norm", "rotary_embedding", "silu_mul",
           "gelu_tanh_mul", "fused_moe"]
