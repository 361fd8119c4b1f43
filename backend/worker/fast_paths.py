"""Where a decode step's forward pass runs, chosen once per runner, in this one place:

- CUDA graphs (cuda_graphs.py): static buffers per padded batch size, a captured graph each, for
  the Triton kernels unless `enforce_eager` (LoRA steps and experts that read their token counts on
  the host run eagerly);
- the CPU's C layer stack (native_decode.py): the whole layer stack in one C call, for packed and
  float weights on the C kernels (issue 47), for every step (decode rows, prompt chunks, both);
- else the model's Python layers.
The runner asks `DecodePath` per step.
"""
from __future__ import annotations

import logging
from typing import Callable, Optional

from backend.core.step import StepPlan
from backend.models.moe import reads_counts_on_host
from backend.worker import native_decode
from backend.worker.cuda_graphs import DecodeGraphs

log = logging.getLogger(__name__)


class DecodePath:
    """A runner's decode fast path: `graphs` (CUDA) or `native` (the CPU's C stack), or neither."""

    def __init__(self, graphs: Optional[DecodeGraphs] = None, native: Optional[native_decode.NativeDecode] = None,
                 native_ranks: Optional[list[bool]] = None):
        self.graphs = graphs
        self.native = native
        self.native_ranks = native_ranks  # tensor parallelism: which ranks run the C stack, by rank

    def graph_size(self, plan: StepPlan) -> Optional[int]:
        """The captured batch size a plan's step runs at (None: eager): pure decode steps only."""
        if self.graphs is None or plan.prefills or any(r.num_new_tokens > 1 for r in plan.padding):
            return None
        return self.graphs.size_for(len(plan.decodes) + len(plan.padding))

    def stack_for(self, num_decode_rows: int, num_rows: int) -> Optional[native_decode.NativeDecode]:
        """The C stack for a step, whatever its rows (decode, empty and verify rows, prompt chunks:
        issue 47), else None. The row counts stay in the signature for a path that takes only some."""
        return self.native


def choose(config, model, ops_name: str, tp, lora, make_graphs: Callable[[], DecodeGraphs]) -> DecodePath:
    """The decode path of a runner, said once in the log."""
    if ops_name == "triton":
        why = ("enforce_eager" if config.enforce_eager else "LoRA steps run eagerly" if lora is not None else
               "the experts run one GEMM per active expert (packed or int8 experts), which reads their token "
               "counts on the host" if reads_counts_on_host(model) else None)
        if why is not None:
            log.info("CUDA graphs off: %s", why)
            return DecodePath()
        graphs = make_graphs()
        graphs.capture()
        return DecodePath(graphs=graphs)
    if ops_name != "cpu":
        return DecodePath()
    why = native_decode.unsupported(model, ops_name, tp)
    log.info("decode and prompt steps%s: %s", f" (tensor-parallel rank {tp.rank})" if tp else "",
             "the layer stack in one C call (backend/worker/native_decode.py)" if why is None else
             f"the Python layers ({why})")
    native = native_decode.NativeDecode(model, tp) if why is None else None
    return DecodePath(native=native, native_ranks=native_decode.native_ranks(tp, native) if tp else None)
