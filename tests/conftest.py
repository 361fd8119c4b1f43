"""Shared test set-up.

TRITON_INTERPRET must be set before triton is first imported anywhere in the process, so it is set
here, at collection time, whenever no CUDA device is present.
"""
import os

# Two cores are shared by the test process and the tritonserver it starts: OpenMP threads that
# spin-wait for a busy core made the suite several times slower, so each process gets one.
os.environ.setdefault("OMP_NUM_THREADS", "1")

try:
    import torch
    _HAS_CUDA = torch.cuda.is_available()
except ImportError:  # pragma: no cover
    _HAS_CUDA = False
if not _HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

# tiers: the slow/e2e marks and the guards of `make test-fast` (tests/tiers.py); pytester: the
# tests of those guards (tests/test_tiers.py).
pytest_plugins = ["tiers", "pytester"]


@pytest.fixture(scope="session")
def default_model_dir(tmp_path_factory):
    """The embedded default model (what `inflight make-model` writes), made once per session."""
    from backend.models.make_model import make_model
    return make_model(tmp_path_factory.mktemp("default-model"))


@pytest.fixture(autouse=True)
def packed_folders_stay_packed(request, monkeypatch):
    """quantization=auto on a packed folder measures packed against dequantized at load on a CPU
    without the AVX512-VNNI kernel (backend/models/cpu_weight_choice.py), which on the tests' tiny
    models could go either way: every other test gets the packed weights it was written for, on
    AVX2-only machines too. tests/test_cpu_weight_choice.py tests the choice itself."""
    if request.module.__name__.endswith("test_cpu_weight_choice"):
        return
    from backend.models import cpu_weight_choice
    from kernels.cpu import quant as cpu_quant
    monkeypatch.setattr(cpu_weight_choice, "FAST_BUILDS", (*cpu_quant.BUILDS, None))


@pytest.fixture
def frozen_heap():
    """The heap as a serving process has it (backend/core/gc_heap.py freezes it after start), for a
    test that times something: a full collection of what earlier tests left in this worker stops
    every thread for 0.1-0.2 s wherever it falls (129 ms in one CI run's flood test). Unfrozen after."""
    import gc

    from backend.core.gc_heap import freeze_heap
    freeze_heap()
    try:
        yield
    finally:
        gc.unfreeze()
