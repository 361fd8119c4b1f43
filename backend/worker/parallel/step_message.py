"""One step as one message from rank 0 to the other tensor-parallel ranks: a fixed-size header
(what to do, the shapes, the step's facts), then one flat int64 payload (the step's int64 array,
then its int32 array's bytes). Two broadcasts per step whatever the model's depth; the layers
exchange nothing else but their all-reduces.

The header is generic over `HostStep`'s fields (backend/worker/step_inputs.py): parts or facts added
there travel without a change here. The collectives that carry it are backend/worker/parallel/group.py's.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import numpy as np

from backend.worker.step_inputs import HostStep

HEADER_LEN = 64
STEP, STOP = 1, 2
_ARRAYS = ("int64", "int64_sizes", "int32", "int32_sizes")
_FACTS = tuple(f.name for f in dataclasses.fields(HostStep) if f.name not in _ARRAYS)
_FLAGS = {f.name for f in dataclasses.fields(HostStep) if f.type in (bool, "bool")}


@dataclass
class StepMessage:
    command: int              # STEP or STOP
    graph_size: int = 0       # the CUDA graph's batch size the step runs at; 0: eager
    host: Optional[HostStep] = None


def encode(message: StepMessage) -> tuple[np.ndarray, np.ndarray]:
    """(header [HEADER_LEN] int64, payload int64)."""
    header = np.zeros(HEADER_LEN, dtype=np.int64)
    header[0], header[1] = message.command, message.graph_size
    host = message.host
    if host is None:
        return header, np.zeros(0, dtype=np.int64)
    if host.int32.shape[0] % 2:
        raise ValueError("the int32 array must hold whole int64 words (its parts are 16-byte aligned)")
    fields = [len(host.int64), len(host.int32), len(host.int64_sizes), len(host.int32_sizes),
              *host.int64_sizes, *host.int32_sizes, *(int(getattr(host, f)) for f in _FACTS)]
    if 2 + len(fields) > HEADER_LEN:
        raise ValueError(f"a step header needs {2 + len(fields)} entries; HEADER_LEN is {HEADER_LEN}")
    header[2:2 + len(fields)] = fields
    payload = np.concatenate([host.int64, host.int32.view(np.int64)])
    return header, payload


def payload_length(header: np.ndarray) -> int:
    """int64 words of the payload that follows this header."""
    if header[0] != STEP:
        return 0
    return int(header[2]) + int(header[3]) // 2


def decode(header: np.ndarray, payload: np.ndarray) -> StepMessage:
    command, graph_size = int(header[0]), int(header[1])
    if command != STEP:
        return StepMessage(command, graph_size)
    n64, n32, p64, p32 = (int(v) for v in header[2:6])
    at = 6
    sizes64 = [int(v) for v in header[at:at + p64]]
    sizes32 = [int(v) for v in header[at + p64:at + p64 + p32]]
    facts = header[at + p64 + p32:at + p64 + p32 + len(_FACTS)]
    values = {f: (bool(v) if f in _FLAGS else int(v)) for f, v in zip(_FACTS, facts)}
    host = HostStep(int64=payload[:n64], int64_sizes=sizes64, int32=payload[n64:].view(np.int32)[:n32],
                    int32_sizes=sizes32, **values)
    return StepMessage(command, graph_size, host)
