"""Which device and dtype the engine runs on (backend/worker/device.py), on a 2-GPU machine as torch.cuda
would describe it (tests/fake_cuda.py)."""
import pytest
import torch

from backend.worker.device import resolve_device, resolve_dtype
from fake_cuda import FakeCuda


@pytest.fixture
def cuda(monkeypatch):
    return FakeCuda().install(monkeypatch)


def test_auto_and_cuda_name_the_current_device_with_its_index(cuda):
    """torch.cuda.set_device refuses torch.device("cuda") (no index): every CUDA device the engine
    resolves carries one, so binding it works."""
    for name in ("auto", "cuda"):
        device = resolve_device(name)
        assert device == torch.device("cuda", 0) and device.index == 0
        torch.cuda.set_device(device)
    torch.cuda.set_device(1)
    assert resolve_device("cuda") == torch.device("cuda", 1)
    assert resolve_device("cuda:0") == torch.device("cuda", 0)
    with pytest.raises(ValueError, match="specified index"):
        torch.cuda.set_device(torch.device("cuda"))   # what the fake shares with torch


def test_a_device_the_machine_does_not_have_is_refused_with_the_count(cuda):
    with pytest.raises(ValueError, match=r"cuda:2.*2 CUDA device\(s\), cuda:0 to cuda:1"):
        resolve_device("cuda:2")


def test_cpu_stays_cpu_and_cuda_without_a_gpu_is_refused(monkeypatch):
    assert resolve_device("cpu") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    with pytest.raises(ValueError, match="CUDA is not available"):
        resolve_device("cuda:0")


CUDA0 = torch.device("cuda", 0)


@pytest.mark.parametrize("checkpoint,capability,expected", [
    ("float32", (9, 0), torch.bfloat16),    # vLLM: float32 checkpoints run in the preferred half type
    ("float32", (8, 0), torch.bfloat16),
    ("float32", (7, 5), torch.float16),     # no bfloat16 before Ampere
    ("bfloat16", (9, 0), torch.bfloat16),
    ("bfloat16", (7, 0), torch.float16),
    ("float16", (9, 0), torch.float16),
    ("unknown", (9, 0), torch.bfloat16),
])
def test_auto_dtype_on_cuda_follows_vllm(checkpoint, capability, expected):
    assert resolve_dtype("auto", checkpoint, CUDA0, capability) == expected


def test_explicit_dtypes_and_the_cpu():
    assert resolve_dtype("float32", "bfloat16", CUDA0, (9, 0)) == torch.float32
    assert resolve_dtype("auto", "bfloat16", torch.device("cpu")) == torch.float32
    assert resolve_dtype("float16", "float32", torch.device("cpu")) == torch.float16
    with pytest.raises(ValueError, match="bfloat16 needs compute capability 8.0.*7.5"):
        resolve_dtype("bfloat16", "float32", CUDA0, (7, 5))


def test_auto_dtype_reads_the_capability_of_its_own_device(cuda):
    cuda.capability = (7, 5)
    assert resolve_dtype("auto", "float32", torch.device("cuda", 1)) == torch.float16
    assert ("get_device_capability", 1) in cuda.calls
