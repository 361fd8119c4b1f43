"""`inflight import-gguf` keeps quantized tensors packed (docs/quantization.md): the packed folder
holds exactly the weights of the `--dequantize` folder (whose values tests/test_gguf_import.py
checks against transformers), once dequantized; float tensors keep their dtype; config.json
names every packed module's type.
"""
import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from backend.models.gguf.importer import LAYOUT, import_gguf
from backend.models.make_model import make_model
from gguf_files import ALL_TYPES, K_SHAPE, K_TYPES, write_gguf
from kernels.quant_reference import ARRAYS, dequantize

QUIET = dict(log=lambda *_: None)


@pytest.fixture(scope="module")
def tiny_tokenizer_json(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("tiny")) / "tokenizer.json"


def packed_modules(tensors: dict) -> dict[str, dict[str, torch.Tensor]]:
    modules: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        prefix, _, part = name.rpartition(".")
        if part != "weight" and part != "bias":
            modules.setdefault(prefix, {})[part] = tensor
    return modules


@pytest.mark.parametrize("arch,types,shape", [
    ("llama", ALL_TYPES, None),  # q/k rows un-permuted on packed arrays
    ("qwen2", ALL_TYPES[3:], None),
    ("llama", K_TYPES, K_SHAPE),
])
def test_packed_folder_dequantizes_to_the_dequantized_folder(tmp_path, tiny_tokenizer_json, arch, types, shape):
    path = tmp_path / "model.gguf"
    write_gguf(path, tiny_tokenizer_json, arch=arch, types=types, shape=shape, tied=False, seed=5)
    packed_dir = import_gguf(path, tmp_path / "packed", **QUIET)
    float_dir = import_gguf(path, tmp_path / "float", dequantize=True, **QUIET)
    packed, floats = load_file(str(packed_dir / "model.safetensors")), load_file(str(float_dir / "model.safetensors"))
    config = json.loads((packed_dir / "config.json").read_text())
    quant = config["quantization_config"]
    assert (quant["quant_method"], quant["layout"], quant["group_size"]) == ("gguf", LAYOUT, 32)
    modules = packed_modules(packed)
    assert set(modules) == set(quant["modules"])
    assert set(quant["modules"].values()) == {t for t in types if t not in ("F32", "F16", "BF16")}
    for prefix, parts in modules.items():
        qtype = quant["modules"][prefix]
        assert set(parts) == set(ARRAYS[qtype]), prefix
        assert torch.equal(dequantize(qtype, parts), floats[prefix + ".weight"]), prefix
    floats_kept = {n: t for n, t in packed.items() if n.endswith(".weight") or n.endswith(".bias")}
    for name, tensor in floats_kept.items():  # F32 / F16 / BF16 tensors as they are in the file
        assert torch.equal(tensor.float(), floats[name]), name
    kept_dtypes = {t.dtype for n, t in floats_kept.items() if t.dim() == 2}
    assert kept_dtypes == {getattr(torch, d) for t, d in (("F32", "float32"), ("F16", "float16"),
                                                           ("BF16", "bfloat16")) if t in types}
    assert set(floats) == {p + ".weight" for p in modules} | set(floats_kept)
    assert config["torch_dtype"] == "bfloat16"
    assert json.loads((float_dir / "config.json").read_text()).get("quantization_config") is None


@pytest.mark.slow
def test_cli_dequantize_flag_and_dtype(tmp_path, tiny_tokenizer_json):
    path = tmp_path / "model.gguf"
    write_gguf(path, tiny_tokenizer_json, types=("Q4_0",))
    run = lambda *extra: subprocess.run(  # noqa: E731
        [sys.executable, "-m", "client.cli", "import-gguf", str(path), *extra],
        capture_output=True, text=True, timeout=120)
    lone_dtype = run("--out", str(tmp_path / "a"), "--dtype", "float16")
    assert lone_dtype.returncode == 2 and "--dtype applies to --dequantize" in lone_dtype.stderr
    done = run("--out", str(tmp_path / "b"), "--dequantize", "--dtype", "bfloat16")
    assert done.returncode == 0, done.stderr
    tensors = load_file(str(tmp_path / "b" / "model.safetensors"))
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    done = run("--out", str(tmp_path / "c"))
    assert done.returncode == 0 and "matrices packed" in done.stdout
    assert any(n.endswith(".qweight") for n in load_file(str(tmp_path / "c" / "model.safetensors")))
