"""One step as one message from rank 0 to the other tensor-parallel ranks: a fixed-size header
(what to do, the CUDA graph's batch size, the payload's length), then the payload: the step plan
the scheduler made (backend/core/step.py: new sequences once, then deltas by id) and the LoRA slot
decisions rank 0's worker made for it, pickled. Every rank applies the plan to its own persistent
batch and builds the same flat inputs from it (backend/worker/step_inputs.py). Two broadcasts per
step whatever the model's depth; the layers exchange nothing else but their all-reduces. The
collectives that carry it are backend/worker/parallel/group.py's.
"""
from __future__ import annotations

import dataclasses
import pickle
from dataclasses import dataclass
from typing import Optional

import numpy as np

from backend.core.step import StepPlan

HEADER_LEN = 4
STEP, STOP = 1, 2


@dataclass
class StepMessage:
    command: int              # STEP or STOP
    graph_size: int = 0       # the CUDA graph's batch size the step runs at; 0: eager
    plan: Optional[StepPlan] = None
    lora: tuple = ((), ())    # rank 0's LoRA runs (first row, end row, slot) and slot writes (slot, load id)


def _for_the_ranks(plan: StepPlan) -> StepPlan:
    """What the other ranks need of a plan: no draft distributions (only rank 0 samples), no KV
    tier copies (refused under tensor parallelism) and no image pixels (rank 0 runs the encoder and
    sends its rows: parallel/vision.py; the ranks keep each image's place and hash)."""
    rows = [dataclasses.replace(r, draft_probs=None) if r.draft_probs is not None else r for r in plan.prefills]
    new = [dataclasses.replace(s, mm_items=tuple(dataclasses.replace(i, pixel_values=None) for i in s.mm_items))
           if s.mm_items else s for s in plan.new_seqs]
    return dataclasses.replace(plan, prefills=rows, kv_copies=None, new_seqs=new)


def encode(message: StepMessage) -> tuple[np.ndarray, np.ndarray]:
    """(header [HEADER_LEN] int64, payload int64 words)."""
    header = np.zeros(HEADER_LEN, dtype=np.int64)
    header[0], header[1] = message.command, message.graph_size
    if message.plan is None:
        return header, np.zeros(0, dtype=np.int64)
    data = pickle.dumps((_for_the_ranks(message.plan), message.lora), protocol=pickle.HIGHEST_PROTOCOL)
    header[2] = len(data)
    payload = np.zeros(-(-len(data) // 8), dtype=np.int64)
    payload.view(np.uint8)[:len(data)] = np.frombuffer(data, dtype=np.uint8)
    return header, payload


def payload_length(header: np.ndarray) -> int:
    """int64 words of the payload that follows this header."""
    return -(-int(header[2]) // 8) if header[0] == STEP else 0


def decode(header: np.ndarray, payload: np.ndarray) -> StepMessage:
    command, graph_size = int(header[0]), int(header[1])
    if command != STEP:
        return StepMessage(command, graph_size)
    plan, lora = pickle.loads(payload.view(np.uint8)[:int(header[2])].tobytes())
    return StepMessage(command, graph_size, plan, lora)
