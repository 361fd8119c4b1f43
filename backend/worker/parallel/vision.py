"""Images under tensor parallelism (docs/vision.md, docs/parallelism.md): the image encoder runs whole
on rank 0, the other ranks take its rows.

The tower is small beside the decoder (Gemma 3's SigLIP: 0.4 B parameters of a 4 B model) and its
output replaces whole embedding rows, which every rank holds alike (the vocabulary-parallel
embedding is all-reduced before they are put in). So rank 0 keeps the encoder and its cache as
with one rank, and each step that has image rows sends them, [rows, text hidden] float32, to the
other ranks in one broadcast after the step message. The other ranks find the same rows and spans
from the same plan and batch (backend/worker/vision.py `VisionStep.prepare`), load no vision
weights (the settings from config.json alone) and keep no cache, and receive the rows in place of
running the encoder. The step message carries no pixels to them (step_message.py). Gemma 3 only:
Qwen2.5-VL's image steps also need M-RoPE rows that rank 0 alone makes, so it is refused at start.
"""
from __future__ import annotations

from typing import Optional

import torch

from backend.models.gemma3_vision import read_vision_config
from backend.models.qwen2_5_vl_vision import is_qwen2_5_vl
from backend.worker.vision import VisionInputs, VisionStep


class _NoEncoder:
    """A rank other than 0 holds the encoder's settings only."""

    def __init__(self, cfg):
        self.cfg = cfg

    def __call__(self, pixels):
        raise RuntimeError("a tensor-parallel rank other than 0 runs no image encoder")


class RankVisionStep(VisionStep):
    """A VisionStep whose rows come from rank 0's encoder on every rank."""

    tp = None

    @classmethod
    def for_rank(cls, config, tp, device: torch.device, verify_as_decode: bool) -> Optional["RankVisionStep"]:
        if is_qwen2_5_vl(config.model_path):  # its image steps' M-RoPE rows are made on rank 0 alone
            raise ValueError("tensor_parallel_size > 1 with a Qwen2.5-VL checkpoint is not supported yet (Gemma 3's "
                             "images are: docs/vision.md)")
        cfg = read_vision_config(config.model_path)  # None: a text-only model
        if cfg is None:
            return None
        step = cls.build(config, None, device, verify_as_decode) if tp.rank == 0 else \
            cls(_NoEncoder(cfg), 0, device, verify_as_decode)  # the settings alone: no weights
        step.tp = tp
        return step

    def prepare(self, plan, batch, empty_rows: int) -> Optional[VisionInputs]:
        inputs = super().prepare(plan, batch, empty_rows)
        if inputs is not None:  # (every rank decides alike: the same plan applied to the same batch)
            inputs.embeds = self.tp.broadcast(inputs.embeds.float().contiguous())
        return inputs

    def attach(self, step, plan, batch, empty_rows: int):
        """A rank other than 0 (the runner's `follow`): the step with its image rows, from rank 0."""
        step.images = self.prepare(plan, batch, empty_rows)
        return step

    def _embeddings(self, items: list, pinned: set[str]) -> dict[str, torch.Tensor]:
        if self.tp.rank == 0:
            return super()._embeddings(items, pinned)
        hidden = self.cfg.text_hidden_size
        return {item.hash: torch.empty(item.length, hidden, dtype=torch.float32, device=self.device)
                for item in items}  # rank 0's values replace these (prepare)


def vision_step(config, tp, device: torch.device, verify_as_decode: bool) -> Optional[VisionStep]:
    """The runner's image encoder step: VisionStep's own with one rank, else this rank's part."""
    if tp is None:
        return VisionStep.build(config, None, device, verify_as_decode)
    return RankVisionStep.for_rank(config, tp, device, verify_as_decode)
