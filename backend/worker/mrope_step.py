"""A Qwen2.5-VL step's rotary positions (docs/vision.md, backend/models/mrope.py), made on the host
from each sequence's images after the step's flat inputs are built (step_inputs.py).

A sequence without images keeps its plain positions. One with images: every token outside its
images' runs is a 1-D position shifted by the images before it (decode rows: + the sequence's rope
delta), so a step without image rows only rewrites `step.positions` (one copy; decode steps, CUDA
graphs and the C stack stay as they are). A step that computes image rows (a prompt chunk over an
image) needs three positions per row: it gets cos/sin rows of its own (`mrope_rows`, one row per
step row) and positions 0..T-1 into them, so every rotary kernel applies M-RoPE unchanged; such a
step runs the Python layers (as Gemma 3's image steps do), the tables being the step's own.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from backend.models.mrope import mrope_positions, mrope_rows
from backend.models.rope import RopeTables
from backend.worker.step_inputs import step_rows


def step_rope(runner, plan, step, empty_rows: int) -> Optional[RopeTables]:
    """The step's own rope tables when it computes image rows (step.positions then 0..T-1); None
    otherwise, step.positions shifted where a sequence's images shift them."""
    vision, section = runner.vision, runner.model_cfg.mrope_section
    if vision is None or not section or not vision.items:
        return None
    decodes, prefills = step_rows(plan, runner.batch, runner.ops.name == "cpu")
    flat: list[int] = [0] * empty_rows
    image_rows = []  # (first flat row, items, start, n) of rows before some image's end
    shifted = False
    for r in decodes + prefills:
        items = vision.items.get(r.seq_id)
        start, n = r.start, r.num_new_tokens
        if items and not r.padding:
            end = delta = 0
            for item in items:  # (plain ints: most rows are one decode token)
                end, delta = max(end, item.offset + item.length), delta + max(item.grid) - item.length
            if start >= end:  # past every image: one shift
                flat += range(start + delta, start + delta + n)
                shifted = True
                continue
            image_rows.append((len(flat), items, start, n))
        flat += range(start, start + n)
    if not shifted and not image_rows:
        return None
    device = step.positions.device
    pos = np.array(flat, dtype=np.int64)[None].repeat(3, axis=0)
    for at, items, start, n in image_rows:
        pos[:, at:at + n] = mrope_positions(items, start, n)
    if (pos[0] == pos[1]).all() and (pos[0] == pos[2]).all():
        step.positions.copy_(torch.from_numpy(pos[0]).to(device))
        return None
    cos, sin = runner.rope.full
    rows = mrope_rows(cos, sin, torch.from_numpy(pos).to(device), section)
    step.positions = torch.arange(pos.shape[1], dtype=torch.int64, device=device)
    return RopeTables(rows, rows)
