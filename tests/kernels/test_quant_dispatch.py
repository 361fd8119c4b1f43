"""kernels/gpu/quant_dispatch.py `quant_linear`, the engine's one call for a quantized linear layer on the
GPU, on what `inflight import-gguf` writes: a GGUF file from the `gguf` package's writer (every
packed type), imported to the packed folder, each matrix read back from its safetensors and
multiplied by the Triton kernels (interpreter, fp16) against the dequantized reference."""
import json

import pytest
import torch
from safetensors.torch import load_file

from backend.models.gguf.importer import import_gguf
from backend.models.make_model import make_model
from gguf_files import ALL_TYPES, K_SHAPE, K_TYPES, write_gguf
from kernel_testutil import DEVICE
from kernels.gpu import quant_dispatch
from kernels.gpu.quant_dispatch import QTYPES, quant_linear
from kernels.quant_formats import linear_reference, logical_shape
from quant_testutil import assert_quant_close


@pytest.fixture(scope="module")
def packed_folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("quant_dispatch")
    tokenizer = make_model(root / "tiny") / "tokenizer.json"
    folders = []
    for name, types, shape in (("small", ALL_TYPES[3:], None), ("kquants", K_TYPES, K_SHAPE)):
        write_gguf(root / f"{name}.gguf", tokenizer, types=types, shape=shape, tied=False, seed=7)
        folders.append(import_gguf(root / f"{name}.gguf", root / name, log=lambda *_: None))
    return folders


def packed_modules(folder) -> list[tuple[str, str, dict]]:
    """(name, qtype, arrays) of every packed matrix of an imported folder."""
    types = json.loads((folder / "config.json").read_text())["quantization_config"]["modules"]
    tensors = load_file(str(folder / "model.safetensors"))
    return [(name, qtype, {a: tensors[f"{name}.{a}"].to(DEVICE) for a in
                           {t.rsplit(".", 1)[1] for t in tensors if t.rsplit(".", 1)[0] == name}})
            for name, qtype in sorted(types.items())]


def test_imported_matrices_of_every_type_run_through_quant_linear(packed_folders):
    seen = set()
    gen = torch.Generator().manual_seed(0)
    for folder in packed_folders:
        for name, qtype, parts in packed_modules(folder):
            if name in ("model.embed_tokens", "lm_head") or qtype in seen:
                continue          # the embedding is looked up by rows; one matrix of each type is enough
            n, k = logical_shape(qtype, parts)
            x = torch.randn(2, 3, k, generator=gen).to(torch.float16).to(DEVICE)   # [batch, tokens, K]
            got = quant_linear(x, qtype, parts)
            assert got.shape == (2, 3, n), name
            flat = x.reshape(6, k)
            assert_quant_close(got.reshape(6, -1), linear_reference(flat, qtype, parts), flat, qtype, parts, name)
            seen.add(qtype)
    assert seen == {"Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"}


def test_on_the_cpu_without_the_interpreter_the_reference_runs(packed_folders, monkeypatch):
    calls = []
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(quant_dispatch, "quant_launches", lambda *args: calls.append(args))
    name, qtype, parts = next(m for m in packed_modules(packed_folders[1]) if m[1] == "Q6_K")
    x = torch.randn(4, parts["qweight"].shape[1] * 2)
    bias = torch.randn(parts["qweight"].shape[0])
    assert torch.equal(quant_linear(x, qtype, parts, bias), linear_reference(x, qtype, parts, bias))
    assert calls == []


def test_unknown_types_are_refused_with_the_supported_list():
    with pytest.raises(ValueError, match="no GPU kernel for 'Q3_K'; supported: Q4_0, .*, AWQ"):
        quant_linear(torch.zeros(1, 32), "Q3_K", {})
    assert set(QTYPES) == {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "Q8_0", "INT8", "FP8", "AWQ"}
