"""Qwen2.5-VL's M-RoPE through the Triton rotary kernel (docs/vision.md): a step over image rows
passes cos/sin rows of its own (backend/models/mrope.py `mrope_rows`) and positions 0..T-1, so the
kernel must equal transformers' formula (`mrope_reference`) on q and k as strided slices of one
fused qkv activation, with Qwen2.5-VL's sections (16/24/24 of a 128-wide head) and positions whose
three streams differ."""
import pytest
import torch

from backend.models.mrope import mrope_positions, mrope_reference, mrope_rows
from backend.models.rope import rope_cos_sin, rope_inv_freq
from kernels.gpu import triton_ops
from kernel_testutil import DEVICE, DTYPES, TOL_ELEMENTWISE, assert_close, seed_for


class _Image:  # an ImageItem's placement: offset, length, grid
    def __init__(self, offset, rows, cols):
        self.offset, self.length, self.grid = offset, rows * cols, (rows, cols)
        self.end = offset + self.length


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 2), (8, 1)])
def test_triton_rotary_with_mrope_rows_matches_transformers(dtype, num_heads, num_kv_heads):
    gen = torch.Generator().manual_seed(seed_for("mrope", dtype, num_heads, num_kv_heads))
    head_dim, section, theta = 128, (16, 24, 24), 1_000_000.0
    images = [_Image(3, 4, 7), _Image(40, 5, 3)]  # a prompt of 61 tokens: text, 28 image rows, text, 15, text
    pos = torch.from_numpy(mrope_positions(images, 0, 61))
    assert not torch.equal(pos[1], pos[2])
    cos, sin = rope_cos_sin(head_dim, 256, theta)
    rows = tuple(t.to(DEVICE) for t in mrope_rows(cos, sin, pos, section))
    qkv = torch.randn(61, num_heads + 2 * num_kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    q, k = qkv[:, :num_heads], qkv[:, num_heads:num_heads + num_kv_heads]
    q_out, k_out = triton_ops.rotary_embedding(q, k, torch.arange(61, device=DEVICE), *rows)
    q_ref, k_ref = mrope_reference(q.cpu(), k.cpu(), pos, rope_inv_freq(head_dim, theta), section)
    assert_close(q_out, q_ref.to(DEVICE), TOL_ELEMENTWISE[dtype], "mrope q")
    assert_close(k_out, k_ref.to(DEVICE), TOL_ELEMENTWISE[dtype], "mrope k")
