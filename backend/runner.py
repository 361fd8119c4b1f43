"""The model runner: the only layer that touches torch devices.

It loads the weights, owns the paged KV cache tensors, turns a SchedulerOutput into flat inputs
(token ids, positions, slot mapping, block tables, sequence lengths), runs the model and samples.
"""
from __future__ import annotations

import logging
import os

import numpy as np
import torch

from backend.attention import AttentionContext
from backend.config import EngineConfig
from backend.cpu_affinity import allowed_cores, pin_omp_threads
from backend.cpu_memory import keep_freed_memory
from backend.loader import ModelConfig
from backend.models.rope import rope_cos_sin
from backend.models.weights import compute_dtype, kv_cache_dtype, load_model
from backend.outputs import Sampled
from backend.sampler import sample
from backend.scheduler import ScheduledSeq, SchedulerOutput
from kernels.dispatch import get_ops

log = logging.getLogger(__name__)
PAD_TOKEN_ID = 0  # what padding rows feed the model; their results are discarded
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device '{name}' requested but CUDA is not available")
    return device


def resolve_dtype(name: str, model_cfg: ModelConfig, device: torch.device) -> torch.dtype:
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cpu":
        return torch.float32  # CPU matmuls in half precision are slow and less exact
    return _DTYPES.get(model_cfg.torch_dtype, torch.bfloat16)


def cpu_threads() -> int:
    """The engine's torch threads on CPU: OMP_NUM_THREADS when set, else every core this process
    may run on but one. OpenMP threads wait for each other at every op; when a core is also busy
    with something else (tritonserver, the client, another process) the op stalls until the
    descheduled thread returns. Measured on a loaded 2-core machine (docs/performance.md): 2
    threads ran the tiny model at 132 tok/s, 1 thread at 933 (SmolLM2 batch 16: 74 vs 109).
    More than one thread are pinned one per core (backend/cpu_affinity.py), as vLLM-CPU binds its
    own; INFLIGHT_CPU_PIN=0 leaves them to the kernel's scheduler. The cores are counted as they
    were before any pinning: a second engine built on a pinned thread gets the same count."""
    if os.environ.get("OMP_NUM_THREADS"):
        return torch.get_num_threads()
    return max(1, len(allowed_cores()) - 1)


def kv_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """KV-cache bytes one token takes: K and V, every layer, every kv head."""
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize


class ModelRunner:
    def __init__(self, config: EngineConfig, model_cfg: ModelConfig, max_model_len: int):
        self.config = config
        self.model_cfg = model_cfg
        self.device = resolve_device(config.device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        else:  # set on the thread that builds the engine, which is the one that steps it
            threads = cpu_threads()
            torch.set_num_threads(threads)
            if 1 < threads <= len(allowed_cores()) and os.environ.get("INFLIGHT_CPU_PIN", "1") != "0":
                log.info("OpenMP threads pinned to cores %s", pin_omp_threads(threads))
            keep_freed_memory()  # no page faults on every step's fresh activations (cpu_memory.py)
        self.dtype = resolve_dtype(config.dtype, model_cfg, self.device)
        self.ops = get_ops(config.attention_backend, self.device, compute_dtype(self.dtype, self.device))
        self.block_size = config.kv_block_size
        # Float, packed-quantized or int8 weights, and the rows a step is padded to (oneDNN's
        # buckets on the CPU fast path): backend/models/weights.py.
        self.weights = load_model(config, model_cfg, self.device, self.dtype, self.ops.name)
        self.model, self.padded_rows = self.weights.model, self.weights.padded_rows
        self.kv_dtype = kv_cache_dtype(config.kv_cache_dtype, self.dtype, self.device, self.weights.quantization)
        cos, sin = rope_cos_sin(model_cfg.head_dim, max_model_len, model_cfg.rope_theta,
                                model_cfg.rope_scaling)
        self.rope = (cos.to(self.device), sin.to(self.device))
        self.num_blocks = self._num_kv_blocks()
        shape = (self.num_blocks, self.block_size, model_cfg.num_kv_heads, model_cfg.head_dim)
        self.kv_caches = [(torch.zeros(shape, dtype=self.kv_dtype, device=self.device),
                           torch.zeros(shape, dtype=self.kv_dtype, device=self.device))
                          for _ in range(model_cfg.num_layers)]
        log.info("KV cache: %d blocks of %d tokens (%.1f MiB) on %s; kernels: %s", self.num_blocks,
                 self.block_size, self.num_blocks * self._bytes_per_block() / 2**20, self.device, self.ops.name)

    # -- KV cache sizing ------------------------------------------------------------------------
    def _bytes_per_block(self) -> int:
        return self.block_size * kv_bytes_per_token(self.model_cfg, self.kv_dtype)

    def _num_kv_blocks(self) -> int:
        cfg = self.config
        if cfg.max_tokens_in_paged_kv_cache > 0:
            return max(1, cfg.max_tokens_in_paged_kv_cache // self.block_size)
        if self.device.type != "cuda":
            return max(1, cfg.cpu_kv_cache_tokens // self.block_size)
        self._warm_up()
        free, _total = torch.cuda.mem_get_info(self.device)
        blocks = int(free * cfg.kv_cache_free_gpu_mem_fraction) // self._bytes_per_block()
        if blocks < 1:
            raise RuntimeError(f"no GPU memory left for the KV cache ({free / 2**30:.2f} GiB free)")
        return blocks

    @torch.inference_mode()
    def _warm_up(self) -> None:
        """Run one full-budget forward pass with a throwaway cache so that the activation peak is
        already taken from the free memory the KV cache is sized from."""
        c = self.model_cfg
        n = min(self.config.max_num_batched_tokens, len(self.rope[0]))
        nblocks = -(-n // self.block_size)
        shape = (nblocks, self.block_size, c.num_kv_heads, c.head_dim)
        caches = [(torch.empty(shape, dtype=self.kv_dtype, device=self.device),) * 2 for _ in range(c.num_layers)]
        table = torch.arange(nblocks, dtype=torch.int32, device=self.device)[None]
        lens = torch.tensor([n], dtype=torch.int32, device=self.device)
        ctx = self._context(kv_caches=caches, slot_mapping=torch.arange(n, device=self.device),
                            num_decode_tokens=0, decode_block_tables=table[:0], decode_seq_lens=lens[:0],
                            prefill_block_tables=table,
                            prefill_cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32, device=self.device),
                            prefill_seq_lens=lens, prefill_max_q_len=n)
        ids = torch.zeros(n, dtype=torch.long, device=self.device)
        hidden = self.model(ids, torch.arange(n, device=self.device), ctx, self.rope)
        self.model.logits(hidden[-1:])
        del caches, ctx, hidden
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()

    # -- one step -------------------------------------------------------------------------------
    def _context(self, **fields) -> AttentionContext:
        return AttentionContext(ops=self.ops, scale=self.model_cfg.head_dim ** -0.5, **fields)

    def _tables(self, seqs: list[ScheduledSeq], empty_rows: int = 0) -> torch.Tensor:
        # Padding rows may attend past their member's blocks: those entries stay 0 (a valid block
        # whose contents only feed discarded rows).
        needed = [-(-(s.start + s.num_new_tokens) // self.block_size) for s in seqs]
        width = max([1] + [len(s.block_table) for s in seqs] + needed)
        padded = np.zeros((empty_rows + len(seqs), width), dtype=np.int32)
        for i, s in enumerate(seqs, start=empty_rows):
            padded[i, :len(s.block_table)] = s.block_table
        return torch.from_numpy(padded).to(self.device, non_blocking=True)

    def _prepare(self, out: SchedulerOutput):
        # Padding rows (padded batches) go through the model like the others: one-token rows with
        # the decodes, longer ones with the prefills. They read their member's cache but are never
        # stored (slot -1) and never sampled.
        decodes = out.decodes + [s for s in out.padding if s.num_new_tokens == 1]
        prefills = out.prefills + [s for s in out.padding if s.num_new_tokens > 1]
        seqs = decodes + prefills
        # Rows that round the step up to a GEMM bucket (CPU fast path) come first, as decode rows of
        # empty sequences: stored nowhere, attending to nothing (their output is zero), never sampled.
        counts = [s.num_new_tokens for s in seqs]
        empty = self.padded_rows(sum(counts)) - sum(counts)
        ids: list[int] = [PAD_TOKEN_ID] * empty
        positions: list[int] = [0] * empty
        slots: list[int] = [-1] * empty
        bs = self.block_size
        for s in seqs:  # plain ints: most rows are one decode token, where numpy costs more
            start, end = s.start, s.start + s.num_new_tokens
            positions.extend(range(start, end))
            if s.padding:
                ids.extend([PAD_TOKEN_ID] * s.num_new_tokens)
                slots.extend([-1] * s.num_new_tokens)
                continue
            table = s.block_table
            ids.extend(s.request.token_ids(start, end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
        dev = self.device
        as_t = lambda a, dt: torch.from_numpy(np.asarray(a, dtype=dt)).to(dev, non_blocking=True)
        q_lens = [s.num_new_tokens for s in prefills]
        d_lens = [0] * empty + [s.start + 1 for s in decodes]
        ctx = self._context(
            kv_caches=self.kv_caches, slot_mapping=as_t(slots, np.int64), num_decode_tokens=len(d_lens),
            decode_block_tables=self._tables(decodes, empty), decode_seq_lens=as_t(d_lens, np.int32),
            prefill_block_tables=self._tables(prefills),
            prefill_cu_seqlens_q=as_t(np.concatenate([[0], np.cumsum(q_lens)]), np.int32),
            prefill_seq_lens=as_t([s.start + s.num_new_tokens for s in prefills], np.int32),
            decode_max_seq_len=max(d_lens, default=0), prefill_max_q_len=max(q_lens, default=0))
        # Logits are needed only at the last token of each sequence that samples this step.
        ends = empty + np.cumsum(counts) - 1
        sample_rows = [int(e) for e, s in zip(ends, seqs) if s.samples]
        sampling = [s.request for s in seqs if s.samples]
        return as_t(ids, np.int64), as_t(positions, np.int64), ctx, sample_rows, sampling

    @torch.inference_mode()
    def run(self, out: SchedulerOutput) -> dict[str, Sampled]:
        """Run one step; returns what every sequence that reached its end sampled, by seq_id."""
        ids, positions, ctx, rows, sampling = self._prepare(out)
        hidden = self.model(ids, positions, ctx, self.rope)
        if not sampling:
            return {}
        logits = self.model.logits(hidden[torch.tensor(rows, device=self.device)])
        return {r.seq_id: s for r, s in zip(sampling, sample(logits, sampling))}
