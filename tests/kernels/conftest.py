"""Kernel-test set-up: every output a kernel wrapper allocates starts as NaN, so an element the
kernel fails to write shows up as a mismatch instead of passing by luck (torch.empty on the CPU is
often zero-filled). Scratch buffers (split-K partials) are poisoned the same way."""
import pytest
import torch

from kernels import checks as _common


def pytest_configure(config):
    config.addinivalue_line("markers", "aot_full: the whole kernels.aot table (tests/kernels/test_aot.py); "
                            "left out of make test, run by make aot")


def _poisoned_alloc(shape, dtype, device):
    t = torch.empty(tuple(shape), dtype=dtype, device=device)
    if dtype.is_floating_point:
        t.fill_(float("nan"))
    else:
        t.fill_(-12345)
    return t


@pytest.fixture(autouse=True)
def poison_outputs(monkeypatch):
    monkeypatch.setattr(_common, "alloc", _poisoned_alloc)
