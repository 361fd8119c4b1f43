"""Helpers for the kernel tests: device/dtype choice, tolerances, paged-cache builders."""
from __future__ import annotations

import zlib

import torch

HAS_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")

# bfloat16 is only checked on a GPU: the Triton interpreter (numpy underneath) mishandles bf16,
# e.g. a plain load/x2/store is off by up to ~6 and tl.dot by orders of magnitude (docs/design.md).
# So bf16 cases exist only where they can run (client/tools/benchmarks/kernel_bench.py checks bf16 on the GPU too).
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if HAS_CUDA else [])

# Tolerances against the fp32-math references, which round their result to the input dtype once.
# - float32: the kernels also compute in fp32 (tl.dot with input_precision="ieee" on GPU, numpy on
#   the interpreter); only summation order and exp2-vs-exp differ -> a few ulps, 1e-5 is ample.
# - float16: the output rounding alone is 2^-11 relative (~5e-4); attention also rounds the softmax
#   probabilities to fp16 before the P@V tensor-core dot (another ~5e-4 relative per term) -> 3e-3.
# - bfloat16: 8 mantissa bits (2^-8 = 3.9e-3 relative per rounding), same two roundings -> 2e-2.
TOL = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=3e-3, rtol=3e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}
# Elementwise kernels (norm, rope, silu) round once, like the reference: ~1 ulp of the dtype.
TOL_ELEMENTWISE = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=1e-3, rtol=1e-3),
    torch.bfloat16: dict(atol=1e-2, rtol=1e-2),
}

# A finite, huge value written into every cache slot no sequence owns (padding blocks, the tail of
# a sequence's last block). A kernel that reads past a sequence's length gets scores and values far
# off, so the comparison fails; the reference masks those positions, so it is unaffected (NaN
# would not work: the reference multiplies masked probabilities, 0, by the values).
POISON = 1000.0


def seed_for(*parts) -> int:
    """A per-case seed, stable across runs and processes (unlike hash())."""
    return zlib.crc32(repr(parts).encode())


def build_paged_cache(seq_lens: list[int], block_size: int, num_kv_heads: int, head_dim: int,
                      dtype: torch.dtype, gen: torch.Generator, spare_blocks: int = 2, pad_cols: int = 2):
    """Random K/V for each sequence scattered into a shuffled paged cache.

    Returns k_cache, v_cache [NB, BS, G, D], block_tables [S, MB] int32 (rows padded with a block
    full of POISON, which no valid position may read).
    """
    bs = block_size
    nblocks = [(n + bs - 1) // bs for n in seq_lens]
    used = sum(nblocks)
    nb = used + spare_blocks + 1
    k_cache = torch.randn(nb, bs, num_kv_heads, head_dim, generator=gen).to(dtype).float()  # fp8 takes no fills
    v_cache = torch.randn(nb, bs, num_kv_heads, head_dim, generator=gen).to(dtype).float()
    perm = torch.randperm(nb, generator=gen)
    poison_block = int(perm[-1])
    owned = torch.zeros(nb, bs, dtype=torch.bool)
    mb = max(nblocks + [1]) + pad_cols
    tables = torch.full((len(seq_lens), mb), poison_block, dtype=torch.int32)
    nxt = 0
    for i, (n, k) in enumerate(zip(seq_lens, nblocks)):
        blocks = perm[nxt:nxt + k]
        nxt += k
        tables[i, :k] = blocks.to(torch.int32)
        for j, b in enumerate(blocks.tolist()):
            owned[b, : min(bs, n - j * bs)] = True
    k_cache[~owned] = POISON
    v_cache[~owned] = POISON
    return k_cache.to(dtype).to(DEVICE), v_cache.to(dtype).to(DEVICE), tables.to(DEVICE)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, tol: dict, what: str = "") -> None:
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert not torch.isnan(actual).any(), f"{what}: NaN in the output (an element was never written?)"
    torch.testing.assert_close(actual.float().cpu(), expected.float().cpu(), **tol, msg=lambda m: f"{what}: {m}")
