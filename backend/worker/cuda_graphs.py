"""Decode steps through static buffers, replayed from CUDA graphs on a GPU.

A decode step of B sequences is padded (with empty rows, backend/worker/step_inputs.py) to the smallest
captured batch size at or above B: 1, 2, 4, 8, then every 16 up to max_num_seqs, as nano-vllm
does. Each size has its static input buffers (token ids, positions, slots, sequence lengths,
block tables) and, on CUDA, a graph of the whole model forward captured at start-up, after the KV
cache is allocated: a step copies its inputs into the buffers, replays the graph (one launch for
the few hundred kernels of a forward pass) and reads the hidden states the graph wrote. Prefill
and mixed steps run eagerly.

The same static-buffer path runs without CUDA (the CPU, the rehearsal): the forward then runs
eagerly on the buffers, so the tests check on the CPU that it gives exactly the eager engine's
tokens. Decode attention's split count depends only on the batch size and max_model_len (the
runner passes max_model_len as the bound, eager or not), so a graph replays exactly the launches
an eager step of that size makes.
"""
from __future__ import annotations

import logging
from typing import Callable, Optional

import torch

from backend.models.attention import AttentionContext
from backend.worker.device import DeviceEnv
from backend.worker.step_inputs import PAD_TOKEN_ID, StepInputs

log = logging.getLogger(__name__)


def batch_sizes(max_num_seqs: int) -> list[int]:
    """The padded batch sizes of decode steps: 1, 2, 4, 8, then every 16, and max_num_seqs."""
    steps = [1, 2, 4, 8] + list(range(16, max_num_seqs, 16))
    return [b for b in steps if b < max_num_seqs] + [max_num_seqs]


class DecodeGraphs:
    """Static buffers per padded batch size, and on CUDA a captured graph each."""

    def __init__(self, env: DeviceEnv, max_num_seqs: int, table_width: int,
                 make_context: Callable[..., AttentionContext], model, rope, groups: int = 1):
        self.env = env
        self.sizes = batch_sizes(max_num_seqs)
        top = self.sizes[-1]
        dev = env.tensor_device
        self.ids = torch.full((top,), PAD_TOKEN_ID, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(top, dtype=torch.int64, device=dev)
        # per KV-cache group (backend/kv/groups.py): its slot mapping and block tables
        self.slots = torch.full((groups, top), -1, dtype=torch.int64, device=dev)
        self.seq_lens = torch.zeros(top, dtype=torch.int32, device=dev)
        self.tables = torch.zeros((groups, top, table_width), dtype=torch.int32, device=dev)
        self.make_context = make_context
        self.model = model
        self.rope = rope
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.replays = 0   # decode steps served from the static buffers

    def size_for(self, num_rows: int) -> Optional[int]:
        """The padded batch size a decode step of num_rows rows runs at; None beyond the largest."""
        return next((b for b in self.sizes if b >= num_rows), None)

    def run(self, step: StepInputs, block_table: torch.Tensor) -> torch.Tensor:
        """The step's hidden states [B, hidden]: its inputs into the buffers, then the forward.
        `block_table`: BlockTables.table, [groups, rows, width]."""
        b = step.ids.shape[0]
        self.ids[:b].copy_(step.ids)
        self.positions[:b].copy_(step.positions)
        self.slots[:, :b].copy_(step.slot_mapping)
        self.seq_lens[:b].copy_(step.decode_seq_lens)
        for group, table in enumerate(block_table):
            torch.index_select(table, 0, step.decode_rows, out=self.tables[group, :b])
        self.replays += 1
        return self.forward_static(b)

    def forward_static(self, b: int) -> torch.Tensor:
        graph = self.graphs.get(b)
        if graph is None:
            return self._forward(b)
        graph.replay()
        return self.outputs[b]

    def _forward(self, b: int) -> torch.Tensor:
        ctx = self.make_context(slot_mapping=self.slots[:, :b], num_decode_tokens=b,
                                decode_block_tables=self.tables[:, :b], decode_seq_lens=self.seq_lens[:b])
        return self.model(self.ids[:b], self.positions[:b], ctx, self.rope)

    def capture(self) -> None:
        """On CUDA: run every size once on empty rows (what it launches is compiled outside the
        capture), then capture its graph, largest first, all in one memory pool (vLLM's order:
        the smaller graphs reuse the larger ones' memory). Elsewhere the buffers run eagerly."""
        if not self.env.can_capture_graphs:
            return
        self.ids.fill_(PAD_TOKEN_ID)
        self.positions.zero_()
        self.slots.fill_(-1)
        self.seq_lens.zero_()
        pool = None
        for b in reversed(self.sizes):
            self._forward(b)
            self.env.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[b] = self._forward(b)
            pool = graph.pool()
            self.graphs[b] = graph
        self.env.synchronize()
        log.info("CUDA graphs captured for decode batch sizes %s", self.sizes)
