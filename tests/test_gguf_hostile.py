"""Hostile and broken GGUF files (issue 22): each ends in one line from `inflight import-gguf` that
names what is wrong (exit status 2), before any tensor is read or any large allocation is made,
and leaves no output folder. The files are good ones written by the `gguf` package's writer
(tests/gguf_files.py) with one thing changed.
"""
import struct

import pytest

from backend.models.gguf.checks import MAX_CONTEXT_LENGTH
from backend.models.gguf.importer import main
from backend.models.make_model import make_model
from gguf_files import patch_bytes, tensor_info_offsets, write_gguf

Q = "blk.0.attn_q.weight"


@pytest.fixture(scope="module")
def tiny_tokenizer_json(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("tiny")) / "tokenizer.json"


def _truncate(path, fraction):
    data = path.read_bytes()
    path.write_bytes(data[:int(len(data) * fraction)])


def _u64(path, where, value):
    patch_bytes(path, where, struct.pack("<Q", value))


CASES = {
    # name: (metadata overrides, what to do to the written file, expected words)
    "truncated in the data": ({}, lambda p: _truncate(p, 0.9), "ends at byte"),
    "truncated in the header": ({}, lambda p: _truncate(p, 0.002), "is truncated"),
    "tensor offset past the end": ({}, lambda p: _u64(p, tensor_info_offsets(p, Q)["offset"], 1 << 40),
                                   f"tensor {Q} (F32 [64, 64]) ends at byte"),
    "absurd dimensions": ({}, lambda p: _u64(p, tensor_info_offsets(p, Q)["dims"], 1 << 62), f"tensor {Q}"),
    "absurd dimension count": ({}, lambda p: patch_bytes(p, tensor_info_offsets(p, Q)["n_dims"], struct.pack("<I", 1000)),
                               f"tensor {Q}: 1000 dimensions (1 to 4)"),
    "absurd tensor count": ({}, lambda p: _u64(p, 8, 1 << 60), "the tensor count 1152921504606846976 is impossible"),
    "absurd metadata count": ({}, lambda p: _u64(p, 16, 1 << 60), "the metadata count 1152921504606846976 is impossible"),
    "zero-size tensor": ({}, lambda p: _u64(p, tensor_info_offsets(p, Q)["dims"], 0), f"tensor {Q} has a zero-size dimension"),
    "head_count 0": ({"head_count": 0}, None, "llama.attention.head_count is 0; it must be a positive integer"),
    "head_count_kv 0": ({"head_count_kv": 0}, None, "llama.attention.head_count_kv is 0"),
    "head_count not dividing the hidden size": ({"head_count": 5}, None,
                                                "llama.embedding_length 64 is not a multiple of llama.attention.head_count 5"),
    "kv heads not dividing the heads": ({"head_count_kv": 3}, None, "llama.attention.head_count_kv is 3; it must be a divisor of llama.attention.head_count 4"),
    "context_length 2^31": ({"context_length": 2 ** 31}, None,
                            f"llama.context_length is 2147483648; it must be an integer in 1..{MAX_CONTEXT_LENGTH}"),
    "shape against the config": ({"feed_forward_length": 100}, None,
                                 "tensor blk.0.ffn_gate.weight has shape [128, 64]; the metadata implies [100, 64]"),
    "more layers than tensors": ({"block_count": 1000}, None,
                                 "llama.block_count is 1000 but the file has tensors for 2 layer(s)"),
    "more layers than an int32": ({"block_count": 2 ** 32 - 1}, None,
                                  "llama.block_count is 4294967295; it must be a positive integer (at most 2147483647)"),
    "fewer layers than tensors": ({"block_count": 1}, None, "is beyond llama.block_count 1"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_hostile_file_is_one_line_error(tmp_path, tiny_tokenizer_json, capsys, case):
    metadata, damage, expected = CASES[case]
    path = tmp_path / "hostile.gguf"
    write_gguf(path, tiny_tokenizer_json, types=("F32",), metadata=metadata)
    if damage:
        damage(path)
    out = tmp_path / "out"
    assert main([str(path), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("inflight import-gguf: "), err
    assert expected in err, err
    assert not out.exists() and not list(tmp_path.glob(".out.partial-*"))


@pytest.mark.parametrize("content,expected", [
    (b"", "is not a GGUF file (0 bytes"),
    (b"PK\x03\x04" + bytes(100), "is not a GGUF file (it does not start with 'GGUF')"),
    (b"GGUF" + struct.pack("<I", 99) + bytes(40), "GGUF version 99 is not supported"),
])
def test_not_a_gguf_file(tmp_path, capsys, content, expected):
    path = tmp_path / "x.gguf"
    path.write_bytes(content)
    assert main([str(path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and expected in err, err


def test_missing_tensor_is_named(tmp_path, tiny_tokenizer_json, capsys):
    path = tmp_path / "m.gguf"
    write_gguf(path, tiny_tokenizer_json, types=("F32",), skip_tensors=("blk.1.ffn_down.weight",))
    assert main([str(path), "--out", str(tmp_path / "out")]) == 2
    assert "1 tensor(s) the metadata implies are missing, e.g. blk.1.ffn_down.weight" in capsys.readouterr().err
