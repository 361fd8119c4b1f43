"""The tensor-parallel all-reduce in C (csrc/shm_reduce.c) over the shared-memory segment of
backend/worker/parallel/shm.py, which lays the segment out and is this kernel's reference (its
Python all_reduce: the same slots, counters and sum order, so the two interleave on one segment and
give the same bits). The C layer stack (decode_stack.py) calls it between its layers without
crossing into Python; `ShmReduce(...)(tensor)` is the checked call, for tests and benchmarks.
"""
from __future__ import annotations

import ctypes

import torch

from kernels.cpu import build as cpu_build

NAME = "shm_reduce"
_P, _I = ctypes.c_void_p, ctypes.c_int64
SUMMED, PYTHON_PATH, STOPPED = 0, 1, 2  # shm_all_reduce's results (STOPPED: closed or failed while waiting)


class _Group(ctypes.Structure):  # shm_reduce.c's shm_group_t
    _fields_ = [("ctrl", _P), ("data", _P), ("rank", _I), ("size", _I), ("slot_bytes", _I), ("failed", _P),
                ("calls", _I), ("seconds", ctypes.c_double)]


class ShmReduce:
    """One rank's view of a segment: `ctrl` and `data` its addresses (the counters' lines, then the
    [2, size, slot_bytes] slots), `failed` the address of this process's int64 failed flag."""

    def __init__(self, ctrl: int, data: int, rank: int, size: int, slot_bytes: int, failed: int):
        if not 0 <= rank < size or slot_bytes <= 0 or not (ctrl and data and failed):
            raise ValueError(f"shm_reduce: rank {rank} of {size}, slot of {slot_bytes} bytes, addresses "
                             f"{ctrl:#x}, {data:#x}, {failed:#x}")
        self.group = _Group(ctrl, data, rank, size, slot_bytes, failed, 0, 0.0)
        self._run = cpu_build.function(NAME, "shm_all_reduce", (_P, _P, _I), restype=ctypes.c_int)
        self.address = ctypes.addressof(self.group)  # what the stack passes to the function below
        self.function = cpu_build.address(self._run)

    def __call__(self, tensor: torch.Tensor) -> int:
        """Sum a contiguous float32 CPU tensor over the ranks in place: SUMMED, or PYTHON_PATH (it
        does not fit a slot, or the segment is unmapped) or STOPPED, and then it is unchanged."""
        if tensor.dtype != torch.float32 or tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ValueError(f"shm_reduce: the tensor must be a contiguous float32 CPU tensor; got "
                             f"{tensor.dtype} {tuple(tensor.shape)} on {tensor.device}")
        return self._run(ctypes.byref(self.group), tensor.data_ptr(), tensor.numel())

    def detach(self) -> None:
        """The segment is being unmapped: every later call takes the Python path."""
        self.group.ctrl = None

    def stats(self) -> tuple[int, float]:
        """All-reduces summed here so far, and their seconds (waiting for the slower rank included)."""
        return self.group.calls, self.group.seconds
