"""RMSNorm, RoPE and SiLU-mul (Triton) against their references, and rope_cos_sin against HF."""
import math

import pytest
import torch

from kernels import reference
from kernels.gpu import triton_ops
from backend.models.rope import rope_cos_sin, rope_inv_freq
from kernel_testutil import DEVICE, DTYPES, TOL_ELEMENTWISE, assert_close, seed_for


# ---------------------------------------------------------------- rms_norm
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 300, 4096])
@pytest.mark.parametrize("with_residual", [True, False])
def test_rms_norm_matches_reference(dtype, hidden, with_residual):
    gen = torch.Generator().manual_seed(seed_for("norm", dtype, hidden, with_residual))
    t = 7
    x = (3 * torch.randn(t, hidden, generator=gen)).to(dtype).to(DEVICE)
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype).to(DEVICE)
    residual = torch.randn(t, hidden, generator=gen).to(dtype).to(DEVICE) if with_residual else None
    out, h = triton_ops.rms_norm(x, weight, 1e-5, residual)
    ref_out, ref_h = reference.rms_norm(x, weight, 1e-5, residual)
    assert_close(out, ref_out, TOL_ELEMENTWISE[dtype], "rms_norm out")
    # The residual sum is one rounding of the same two inputs: exact.
    assert torch.equal(h, ref_h)
    if not with_residual:
        assert h is x


def test_rms_norm_strided_input_and_fp32_weight():
    gen = torch.Generator().manual_seed(seed_for("norm-strided"))
    big = torch.randn(5, 2 * 300, generator=gen).to(torch.float16).to(DEVICE)
    x = big[:, ::2]                 # non-unit column stride
    residual = big[:, 1::2]
    weight = torch.randn(300, generator=gen).to(DEVICE)   # fp32 weight with fp16 activations
    out, h = triton_ops.rms_norm(x, weight, 1e-6, residual)
    ref_out, ref_h = reference.rms_norm(x, weight, 1e-6, residual)
    assert_close(out, ref_out, TOL_ELEMENTWISE[torch.float16], "rms_norm strided")
    assert torch.equal(h, ref_h)


def test_rms_norm_rejects_bad_arguments():
    x = torch.zeros(3, 8, device=DEVICE)
    with pytest.raises(ValueError, match="weight must have shape"):
        triton_ops.rms_norm(x, torch.ones(7, device=DEVICE), 1e-5)
    with pytest.raises(ValueError, match="residual shape"):
        triton_ops.rms_norm(x, torch.ones(8, device=DEVICE), 1e-5, torch.zeros(3, 7, device=DEVICE))
    with pytest.raises(ValueError, match="x must be 2-D"):
        triton_ops.rms_norm(x[None], torch.ones(8, device=DEVICE), 1e-5)


# ---------------------------------------------------------------- rotary_embedding
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2), (8, 1)])
def test_rotary_matches_reference(dtype, head_dim, num_heads, num_kv_heads):
    gen = torch.Generator().manual_seed(seed_for("rope", dtype, head_dim, num_heads, num_kv_heads))
    t, max_pos = 9, 200
    cos, sin = rope_cos_sin(head_dim, max_pos, 500000.0, {"rope_type": "llama3", "factor": 8.0,
                                                          "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                          "original_max_position_embeddings": 64})
    cos, sin = cos.to(DEVICE), sin.to(DEVICE)
    # q and k as strided slices of one fused qkv activation.
    qkv = torch.randn(t, num_heads + 2 * num_kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    q, k = qkv[:, :num_heads], qkv[:, num_heads:num_heads + num_kv_heads]
    positions = torch.randint(0, max_pos, (t,), generator=gen)
    positions[0], positions[1] = 0, max_pos - 1
    positions = positions.to(DEVICE)
    q_out, k_out = triton_ops.rotary_embedding(q, k, positions, cos, sin)
    q_ref, k_ref = reference.rotary_embedding(q, k, positions, cos, sin)
    assert_close(q_out, q_ref, TOL_ELEMENTWISE[dtype], "rope q")
    assert_close(k_out, k_ref, TOL_ELEMENTWISE[dtype], "rope k")


def test_rotary_rejects_bad_arguments():
    q, k = torch.zeros(3, 4, 64, device=DEVICE), torch.zeros(3, 2, 64, device=DEVICE)
    cos = torch.zeros(10, 32, device=DEVICE)
    pos = torch.zeros(3, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="cos/sin caches"):
        triton_ops.rotary_embedding(q, k, pos, cos[:, :16], cos[:, :16])
    with pytest.raises(ValueError, match="positions must have shape"):
        triton_ops.rotary_embedding(q, k, pos[:2], cos, cos)
    with pytest.raises(ValueError, match="cos_cache must have dtype"):
        triton_ops.rotary_embedding(q, k, pos, cos.half(), cos)


# ---------------------------------------------------------------- rope_cos_sin vs HF transformers
def _hf_config(head_dim, theta, rope_scaling):
    from transformers import LlamaConfig
    params = {"rope_type": "default", "rope_theta": theta}
    if rope_scaling:
        params.update(rope_scaling)
    return LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim,
                       max_position_embeddings=4096, rope_parameters=params)


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}


@pytest.mark.parametrize("head_dim,theta,scaling", [
    (128, 500000.0, LLAMA3),                                   # Llama-3.1/3.2 exactly
    (64, 500000.0, dict(LLAMA3, factor=32.0, original_max_position_embeddings=512)),
    (128, 10000.0, None),
    (64, 1000000.0, {"rope_type": "linear", "factor": 4.0}),
])
def test_rope_cos_sin_matches_transformers(head_dim, theta, scaling):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = _hf_config(head_dim, theta, scaling)
    if scaling:
        hf_inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](config, torch.device("cpu"))
    else:
        hf_inv_freq, attention_scaling = LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    assert attention_scaling == 1.0
    ours = rope_inv_freq(head_dim, theta, scaling)
    assert ours.dtype == torch.float32
    assert torch.equal(ours, hf_inv_freq.float()), "inv_freq differs from transformers"

    # The caches against HF's own rotary embedding module (cos/sin for the same positions).
    max_pos = 2048
    cos, sin = rope_cos_sin(head_dim, max_pos, theta, scaling)
    assert cos.shape == sin.shape == (max_pos, head_dim // 2) and cos.dtype == torch.float32
    rotary = LlamaRotaryEmbedding(config)
    positions = torch.tensor([[0, 1, 7, 100, 1000, max_pos - 1]])
    hf_cos, hf_sin = rotary(torch.zeros(1, dtype=torch.float32), positions)
    half = head_dim // 2
    torch.testing.assert_close(cos[positions[0]], hf_cos[0, :, :half], atol=1e-6, rtol=0)
    torch.testing.assert_close(sin[positions[0]], hf_sin[0, :, :half], atol=1e-6, rtol=0)
    torch.testing.assert_close(hf_cos[0, :, half:], hf_cos[0, :, :half], atol=0, rtol=0)  # HF's [f | f] layout


def test_llama3_scaling_changes_only_low_frequencies():
    # A sanity check that does not rely on transformers: high frequencies untouched, the lowest
    # divided by the factor, the band between strictly in between.
    plain = rope_inv_freq(128, 500000.0)
    scaled = rope_inv_freq(128, 500000.0, LLAMA3)
    wavelen = 2 * math.pi / plain
    high = wavelen < 8192 / 4.0
    low = wavelen > 8192 / 1.0
    assert high.any() and low.any()
    assert torch.equal(scaled[high], plain[high])
    torch.testing.assert_close(scaled[low], plain[low] / 8.0)
    mid = ~high & ~low
    assert ((scaled[mid] < plain[mid]) & (scaled[mid] > plain[mid] / 8.0)).all()


def test_rope_cos_sin_rejects_unsupported():
    with pytest.raises(ValueError, match="not supported"):
        rope_cos_sin(64, 16, 10000.0, {"rope_type": "yarn", "factor": 2.0})
    with pytest.raises(ValueError, match="missing"):
        rope_cos_sin(64, 16, 10000.0, {"rope_type": "llama3", "factor": 8.0})
    with pytest.raises(ValueError, match="even"):
        rope_cos_sin(63, 16, 10000.0)


# ---------------------------------------------------------------- silu_mul
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [64, 700, 2500])   # 2500 > one 1024-wide column block
def test_silu_mul_matches_reference(dtype, inter):
    gen = torch.Generator().manual_seed(seed_for("silu", dtype, inter))
    big = (4 * torch.randn(5, 2 * inter + 3, generator=gen)).to(dtype).to(DEVICE)
    x = big[:, 1:2 * inter + 1]      # a strided row view
    assert_close(triton_ops.silu_mul(x), reference.silu_mul(x), TOL_ELEMENTWISE[dtype], "silu_mul")


def test_silu_mul_rejects_odd_width():
    with pytest.raises(ValueError, match="even"):
        triton_ops.silu_mul(torch.zeros(2, 7, device=DEVICE))
