"""The packed layout of docs/quantization.md against the `gguf` package's own dequantization (an
oracle we did not write): ggml blocks of every packed type, with random codes and scales, split by
backend/models/gguf/packed.py and dequantized by kernels/quant_reference.py, equal gguf's floats to the bit.
"""
import numpy as np
import pytest
import torch

from backend.models.gguf.packed import BLOCK_SIZES, PACKED_TYPES, TYPE_IDS, pack
from kernels.quant_reference import ARRAYS, codes, dequantize

# byte offsets of the float16 fields (d, m / dmin) inside each type's block
F16_FIELDS = {"Q8_0": [0], "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2],
              "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}


def random_blocks(qtype: str, rows: int, blocks: int, seed: int) -> np.ndarray:
    """ggml blocks with random bytes (any bytes are valid codes and sub-scales) and finite, small
    float16 scales: [rows, blocks * bytes]."""
    rng = np.random.default_rng(seed)
    _, nbytes = BLOCK_SIZES[TYPE_IDS[qtype]]
    raw = rng.integers(0, 256, (rows, blocks, nbytes), dtype=np.uint8)
    for offset in F16_FIELDS[qtype]:
        scale = (rng.standard_normal((rows, blocks, 1)) * 0.02).astype(np.float16)
        raw[:, :, offset:offset + 2] = scale.view(np.uint8)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("qtype", sorted(PACKED_TYPES.values()))
def test_packed_arrays_dequantize_to_ggml_values_bit_for_bit(qtype):
    import gguf
    per_block, _ = BLOCK_SIZES[TYPE_IDS[qtype]]
    rows, blocks = 7, 3  # 7 rows: nothing here assumes a multiple of anything
    raw = random_blocks(qtype, rows, blocks, seed=len(qtype) + per_block)
    parts = pack(raw, TYPE_IDS[qtype], (rows, blocks * per_block))
    assert set(parts) == set(ARRAYS[qtype])
    tensors = {k: torch.from_numpy(v) for k, v in parts.items()}
    ours = dequantize(qtype, tensors).numpy()
    theirs = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype])
    assert ours.dtype == np.float32 and ours.shape == theirs.shape
    assert np.array_equal(ours, theirs), f"{qtype}: max diff {np.abs(ours - theirs).max()}"
    # any subset of rows dequantizes alone (the quantized embedding looks rows up this way)
    picked = torch.tensor([5, 0, 5])
    subset = dequantize(qtype, {k: v[picked] for k, v in tensors.items()}).numpy()
    assert np.array_equal(subset, theirs[[5, 0, 5]])


def test_array_shapes_and_dtypes_are_the_documented_ones():
    k, n = 512, 3
    expected = {  # name -> (dtype, columns) for K = 512
        "Q8_0": {"qweight": (np.int8, 512), "scales": (np.float16, 16)},
        "Q4_1": {"qweight": (np.uint8, 256), "scales": (np.float16, 16), "mins": (np.float16, 16)},
        "Q5_0": {"qweight": (np.uint8, 256), "qhigh": (np.uint8, 64), "scales": (np.float16, 16)},
        "Q4_K": {"qweight": (np.uint8, 256), "scales": (np.float16, 2), "mins": (np.float16, 2),
                 "sub_scales": (np.uint8, 16), "sub_mins": (np.uint8, 16)},
        "Q5_K": {"qweight": (np.uint8, 256), "qhigh": (np.uint8, 64), "scales": (np.float16, 2),
                 "mins": (np.float16, 2), "sub_scales": (np.uint8, 16), "sub_mins": (np.uint8, 16)},
        "Q6_K": {"qweight": (np.uint8, 256), "qhigh": (np.uint8, 128), "scales": (np.float16, 2),
                 "sub_scales": (np.int8, 32)},
    }
    for qtype, arrays in expected.items():
        per_block = BLOCK_SIZES[TYPE_IDS[qtype]][0]
        parts = pack(random_blocks(qtype, n, k // per_block, 1), TYPE_IDS[qtype], (n, k))
        assert {name: (a.dtype.type, a.shape) for name, a in parts.items()} == \
            {name: (dt, (n, cols)) for name, (dt, cols) in arrays.items()}, qtype


def test_nibble_order_and_bit_planes_are_the_documented_ones():
    # One Q5_0 group whose codes are 0..31: byte i of qweight holds codes i (low) and i + 16 (high);
    # bit i of the qhigh plane is bit 4 of code i.
    q = np.arange(32, dtype=np.uint8)
    block = np.zeros(22, np.uint8)
    block[0:2] = np.array([1.0], np.float16).view(np.uint8)
    block[2:6] = np.array([sum(1 << i for i in range(32) if q[i] & 16)], "<u4").view(np.uint8)
    block[6:22] = (q[:16] & 15) | ((q[16:] & 15) << 4)
    parts = pack(block[None], TYPE_IDS["Q5_0"], (1, 32))
    assert list(parts["qweight"][0]) == [i | (i << 4) for i in range(16)]
    assert int(parts["qhigh"][0].view("<u4")[0]) == 0xFFFF0000
    got = codes("Q5_0", {k: torch.from_numpy(v) for k, v in parts.items()})
    assert got.tolist() == [list(range(32))]


def test_wrong_sizes_are_refused():
    with pytest.raises(ValueError, match="needs 36 bytes; it has 34"):
        pack(np.zeros(34, np.uint8), TYPE_IDS["Q4_0"], (2, 32))
    with pytest.raises(ValueError, match="rows of 48 values are not whole blocks of 32"):
        pack(np.zeros(27, np.uint8), TYPE_IDS["Q4_0"], (1, 48))
