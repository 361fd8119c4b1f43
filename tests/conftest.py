"""Shared test set-up.

TRITON_INTERPRET must be set before triton is first imported anywhere in the process, so it is set
here, at collection time, whenever no CUDA device is present.
"""
import os

try:
    import torch
    _HAS_CUDA = torch.cuda.is_available()
except ImportError:  # pragma: no cover
    _HAS_CUDA = False
if not _HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
