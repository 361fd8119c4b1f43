"""The model runner: the only layer that touches torch devices.

It loads the weights, owns the paged KV cache tensors, turns a SchedulerOutput into flat inputs
(backend/worker/step_inputs.py), runs the model (decode steps through CUDA graphs where it can,
backend/worker/cuda_graphs.py) and samples. On CUDA it binds its device to the engine thread, and while
it holds the GPU's lock (backend/worker/memory.py) it loads the weights, runs the warm-up, sizes and
allocates the KV cache and captures the graphs.

With tensor_parallel_size N (backend/parallel/) the runner of rank 0 starts the group: it holds its
shard of every layer and of the KV cache, sends each step's inputs to the other ranks as one
message (`run`), and samples from the gathered logits; the runner of every other rank loads its
own shard the same way and computes the steps rank 0 sends (`follow`).
"""
from __future__ import annotations

import functools
import logging
import os
from typing import Optional

import torch

from backend.models.attention import AttentionContext
from backend.core.config import EngineConfig
from backend.worker.cpu_affinity import allowed_cores, pin_omp_threads
from backend.worker.cpu_memory import keep_freed_memory
from backend.worker.cuda_graphs import DecodeGraphs
from backend.worker import memory
from backend.worker.device import DeviceEnv, resolve_device, resolve_dtype
from backend.kv.groups import kv_layout
from backend.kv.sizing import blocks_that_fit, check_block_tables, check_kv_cache, kv_bytes_per_token
from backend.worker.kv_copier import KVCopier
from backend.models.loader import ModelConfig
from backend.worker import native_decode
from backend.worker.lora.manager import make_lora_manager
from backend.models.llama import LlamaForCausalLM
from backend.models.expert_load import ExpertLoad
from backend.models.moe import reads_counts_on_host
from backend.models.rope import rope_tables
from backend.models.weights import compute_dtype, kv_cache_dtype, load_model
from backend.worker.parallel.rendezvous import start_group
from backend.worker.sampler import sample
from backend.core.step import Sampled, SchedulerOutput
from backend.worker.rejection import verify
from backend.worker.step_inputs import BlockTables, StepInputs, build_step, place_step
from backend.worker.warmup import prefill_tokens, warm_up_steps
from kernels.dispatch import get_ops

log = logging.getLogger(__name__)
__all__ = ["ModelRunner", "kv_bytes_per_token", "cpu_threads"]


def cpu_threads(ranks: int = 1) -> int:
    """The engine's torch threads on CPU: OMP_NUM_THREADS when set, else every core this process
    may run on but one. OpenMP threads wait for each other at every op; when a core is also busy
    with something else (tritonserver, the client, another process) the op stalls until the
    descheduled thread returns. Measured on a loaded 2-core machine (docs/performance.md): 2
    threads ran the tiny model at 132 tok/s, 1 thread at 933 (SmolLM2 batch 16: 74 vs 109).
    More than one thread are pinned one per core (backend/worker/cpu_affinity.py), as vLLM-CPU binds its
    own; INFLIGHT_CPU_PIN=0 leaves them to the kernel's scheduler. The cores are counted as they
    were before any pinning: a second engine built on a pinned thread gets the same count.
    `ranks`: tensor-parallel ranks on this machine, which share the cores."""
    if os.environ.get("OMP_NUM_THREADS"):
        return torch.get_num_threads()
    return max(1, (len(allowed_cores()) - 1) // ranks)


class ModelRunner:
    def __init__(self, config: EngineConfig, model_cfg: ModelConfig, max_model_len: int, tp=None):
        self.tp = tp if tp is not None else start_group(config, model_cfg, max_model_len)  # None: one rank
        try:
            self.whole_model_cfg = model_cfg  # the rank's own is its shard's (self.model_cfg)
            self._start(config, self.tp.plan.local_config(model_cfg) if self.tp else model_cfg, max_model_len)
        except BaseException:
            if self.tp:  # the other ranks may be anywhere in their own start: end them
                self.tp.close(graceful=False)
            raise

    def _start(self, config: EngineConfig, model_cfg: ModelConfig, max_model_len: int) -> None:
        self.config = config
        self.model_cfg, self.max_model_len = model_cfg, max_model_len
        self.env = DeviceEnv.for_device(resolve_device(config.device))
        self.device = self.env.device   # what the engine runs on and reports (cuda:1)
        self.env.bind()
        if not self.env.is_cuda:  # set on the thread that builds the engine, which is the one that steps it
            threads = cpu_threads(self.tp.size if self.tp else 1)
            torch.set_num_threads(threads)
            cores = allowed_cores()[(self.tp.rank if self.tp else 0) * threads:][:threads]  # each rank its own
            if 1 < threads == len(cores) and os.environ.get("INFLIGHT_CPU_PIN", "1") != "0":
                log.info("OpenMP threads pinned to cores %s", pin_omp_threads(threads, cores))
            keep_freed_memory()  # no page faults on every step's fresh activations (cpu/memory.py)
        self.dtype = resolve_dtype(config.dtype, model_cfg.torch_dtype, self.device)
        self.ops = get_ops(config.attention_backend, self.device, compute_dtype(self.dtype, self.device))
        self.block_size = config.kv_block_size
        self.kv_layout = kv_layout(model_cfg.layer_windows, model_cfg.num_layers)  # backend/kv/groups.py
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.graphs: Optional[DecodeGraphs] = None
        self.kv_copier: Optional[KVCopier] = None  # the KV tiers' host pool and copies, when on
        with memory.one_engine_at_a_time(self.env):  # engines on one GPU load and size one after another
            self.model = self._load_model()
            self.lora = make_lora_manager(config, self.whole_model_cfg, self.model, self.ops.name,
                                          self.env.tensor_device, tp=self.tp)
            self.rope = rope_tables(model_cfg, max_model_len, self.env.tensor_device)
            width = -(-max_model_len // self.block_size)
            check_block_tables(config, width, memory.available_bytes(self.env), self.kv_layout.num_groups)
            self.tables = BlockTables(config.max_num_seqs, width, self.block_size, self.env.tensor_device,
                                      groups=self.kv_layout.num_groups)
            self.num_blocks = self._num_kv_blocks()
            if self.tp:  # the scheduler sees one engine: the group holds what its smallest rank holds
                self.num_blocks = self.tp.smallest(self.num_blocks)
            if not (self.env.is_cuda and config.max_tokens_in_paged_kv_cache == 0):  # else sized to what is free
                check_kv_cache(config, self.num_blocks, self._bytes_per_block(), memory.available_bytes(self.env))
            self.kv_caches = self._allocate_kv(self.num_blocks)
            self.graphs = self._decode_graphs()
            native_decode.attach(self.model, self.ops.name, self.tp)  # CPU: one C call a decode step
        if self.expert_load is not None:
            self.expert_load.reset()
        log.info("KV cache: %d blocks of %d tokens (%.1f MiB) on %s; kernels: %s; CUDA graphs: %s", self.num_blocks,
                 self.block_size, self.num_blocks * self._bytes_per_block() / 2**20, self.device, self.ops.name,
                 bool(self.graphs and self.graphs.graphs))

    # -- weights (the one place they are loaded) -------------------------------------------------
    def _load_model(self) -> LlamaForCausalLM:
        """Float, packed-quantized or int8 weights, the rows a step is padded to (oneDNN's buckets
        on the CPU fast path) and the KV cache's dtype: backend/models/weights.py."""
        self.weights = load_model(self.config, self.model_cfg, self.device, self.dtype, self.ops.name,
                                  tensor_device=self.env.tensor_device, tp=self.tp)
        self.padded_rows = self.weights.padded_rows
        # tokens per expert, counted on the device (MoE models; rows: a step's most, padded)
        rows = max(self.padded_rows(self.config.max_num_batched_tokens), self.config.max_num_seqs)
        self.expert_load = ExpertLoad.attach(self.weights.model, rows, self.env.tensor_device)
        self.kv_dtype = kv_cache_dtype(self.config.kv_cache_dtype, self.dtype, self.device, self.weights.quantization)
        return self.weights.model

    # -- KV cache --------------------------------------------------------------------------------
    def _bytes_per_block(self) -> int:
        """A block of the pool: block_size tokens of a KV-cache group's layers (`slots` of them)."""
        per_layer = kv_bytes_per_token(self.model_cfg, self.kv_dtype) // self.model_cfg.num_layers
        return self.block_size * per_layer * self.kv_layout.slots

    def _num_kv_blocks(self) -> int:
        cfg = self.config
        if self.env.is_cuda:  # the warm-up runs on every GPU start: it compiles what serving launches
            mem = memory.measure(self.env, self._warm_up)
            if cfg.max_tokens_in_paged_kv_cache == 0:  # a draft model (rank 0 runs it) shares the budget
                share = memory.draft_cache_share(cfg, self.device, self.kv_dtype) if not (self.tp and self.tp.rank) else None
                return blocks_that_fit(mem, cfg.kv_cache_free_gpu_mem_fraction, self._bytes_per_block(), self.device,
                                       share, self.block_size)
        tokens = cfg.max_tokens_in_paged_kv_cache if cfg.max_tokens_in_paged_kv_cache > 0 else cfg.cpu_kv_cache_tokens
        # the memory of that many tokens in every layer: as many blocks of a group's layers
        return max(1, tokens // self.block_size * self.model_cfg.num_layers // self.kv_layout.slots)

    def _allocate_kv(self, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's K and V cache: `slots` pairs of tensors, layer k of every KV-cache group
        reading pair k through its group's block tables (backend/kv/groups.py)."""
        c, layout = self.model_cfg, self.kv_layout
        shape = (num_blocks, self.block_size, c.num_kv_heads, c.head_dim)
        pairs = [(torch.zeros(shape, dtype=self.kv_dtype, device=self.env.tensor_device),
                  torch.zeros(shape, dtype=self.kv_dtype, device=self.env.tensor_device)) for _ in range(layout.slots)]
        return [pairs[slot] for slot in layout.layer_slot]

    def _warm_up(self) -> None:
        """backend/worker/warmup.py's steps through run(), on a throwaway cache."""
        cfg = self.config
        n = prefill_tokens(cfg.max_num_batched_tokens, self.max_model_len)
        self.kv_caches = self._allocate_kv(-(-n // self.block_size) + 1)
        try:
            for out in warm_up_steps(cfg.max_num_batched_tokens, cfg.max_num_seqs, self.max_model_len,
                                     self.block_size, self.model_cfg.vocab_size):
                for s in out.seqs:  # a throwaway cache: every group may write the same blocks
                    s.group_tables = (s.block_table,) * (self.kv_layout.num_groups - 1)
                self.run(out)
        finally:
            self.kv_caches = []
            self.tables.reset()

    # -- KV tiers (backend/kv_tiers/): the host pool, and a step's copies before its model run ------
    def attach_kv_copier(self, host_bytes: int) -> KVCopier:
        """The host pool and its copies to and from this runner's KV cache (backend/worker/kv_copier.py):
        the KV tiers' bookkeeping makes each step's copies through it before the step's model run."""
        self.kv_copier = KVCopier(self.env, self.kv_caches, host_bytes)
        return self.kv_copier

    # -- CUDA graphs -----------------------------------------------------------------------------
    def _decode_graphs(self) -> Optional[DecodeGraphs]:
        """Decode steps through static buffers (graphs captured on CUDA) unless enforce_eager, or
        with kernels other than Triton's (the references size their work from the lengths)."""
        if self.config.enforce_eager or self.ops.name != "triton" or self.lora is not None:
            return None  # (LoRA steps run eagerly: docs/lora.md)
        if reads_counts_on_host(self.model):
            log.info("CUDA graphs off: the experts run one GEMM per active expert (packed or int8 experts), "
                     "which reads their token counts on the host")
            return None
        empty_i32 = torch.zeros(1, dtype=torch.int32, device=self.env.tensor_device)
        make_context = functools.partial(
            self._context, kv_caches=self.kv_caches, prefill_block_tables=self.tables.table[:, :0],
            prefill_cu_seqlens_q=empty_i32, prefill_seq_lens=empty_i32[:0], decode_max_seq_len=self.max_model_len)
        graphs = DecodeGraphs(self.env, self.config.max_num_seqs, self.tables.width, make_context, self.model, self.rope,
                              groups=self.kv_layout.num_groups)
        graphs.capture()
        return graphs

    # -- one step --------------------------------------------------------------------------------
    def _context(self, **fields) -> AttentionContext:
        cfg = self.model_cfg
        groups = self.kv_layout.layer_group if self.kv_layout.num_groups > 1 else ()
        return AttentionContext(ops=self.ops, scale=cfg.attention_scale, layer_windows=cfg.layer_windows,
                                layer_groups=groups, **fields)

    def prefill_context(self, num_tokens: int) -> AttentionContext:
        """The context of one sequence's prefill of num_tokens tokens from position 0 on a
        throwaway cache of its own (client/tools/quality/perplexity.py scores texts this way)."""
        blocks, groups, dev = -(-num_tokens // self.block_size), self.kv_layout.num_groups, self.env.tensor_device
        table = torch.arange(groups * blocks, dtype=torch.int32, device=dev).view(groups, 1, blocks)  # a group each
        positions = torch.arange(num_tokens, device=dev)
        slots = (table[:, 0, positions // self.block_size] * self.block_size + positions % self.block_size).long()
        lens = torch.tensor([num_tokens], dtype=torch.int32, device=dev)
        return self._context(kv_caches=self._allocate_kv(groups * blocks), slot_mapping=slots, num_decode_tokens=0,
                             decode_block_tables=table[:, :0], decode_seq_lens=lens[:0], prefill_block_tables=table,
                             prefill_cu_seqlens_q=torch.tensor([0, num_tokens], dtype=torch.int32, device=dev),
                             prefill_seq_lens=lens, prefill_max_q_len=num_tokens)

    def _step_context(self, step: StepInputs) -> AttentionContext:
        table = self.tables.table
        # The Triton kernel's split count follows the batch and this bound only, so an eager decode
        # and a graph replay of the same batch launch the same; the references pad to the real max.
        max_seq_len = self.max_model_len if self.ops.name == "triton" else step.decode_max_seq_len
        return self._context(
            kv_caches=self.kv_caches, slot_mapping=step.slot_mapping, num_decode_tokens=step.num_decode_rows,
            decode_block_tables=table[:, :, :step.decode_width].index_select(1, step.decode_rows),
            decode_seq_lens=step.decode_seq_lens,
            prefill_block_tables=table[:, :, :step.prefill_width].index_select(1, step.prefill_rows),
            prefill_cu_seqlens_q=step.prefill_cu_seqlens_q, prefill_seq_lens=step.prefill_seq_lens,
            decode_max_seq_len=max_seq_len, prefill_max_q_len=step.prefill_max_q_len,
            lora=self.lora.step(step.lora_runs, step.lora_writes, step.ids.shape[0]) if self.lora is not None else None)

    def _graph_size(self, out) -> Optional[int]:
        if self.graphs is None or out.prefills or any(s.num_new_tokens > 1 for s in out.padding):
            return None
        return self.graphs.size_for(len(out.decodes) + len(out.padding))

    @torch.inference_mode()
    def run(self, out: SchedulerOutput) -> dict[str, Sampled]:
        """Run one step (a SchedulerOutput); returns what every sequence that reached its end
        sampled, by seq_id (a verify row's drafts checked by backend/worker/rejection.py). On a
        tensor-parallel rank other than 0 (the warm-up's steps) it computes the step rank 0 sends
        instead."""
        if self.tp and self.tp.rank:
            self.follow()
            return {}
        logits, step = self.forward(out)
        if logits is None or not step.sampling:
            return {}
        if step.has_drafts:
            return verify(logits, step.sampled_seqs)
        return {r.seq_id: s for r, s in zip(step.sampling, sample(logits, step.sampling))}

    @torch.inference_mode()
    def forward(self, out: SchedulerOutput) -> tuple[Optional[torch.Tensor], StepInputs]:
        """The model run of a step: the logits of the positions that sample (None if none does)."""
        size = self._graph_size(out)
        if size is not None:
            empty = size - len(out.decodes) - len(out.padding)
        else:
            tokens = out.num_batched_tokens
            empty = self.padded_rows(tokens) - tokens
        send = self.tp and (lambda host: self.tp.send_step(host, size or 0))  # noqa: E731
        step = build_step(out, self.tables, empty, verify_as_decode=self.ops.name == "cpu", send=send, lora=self.lora)
        return self._compute(step, size), step

    @torch.inference_mode()
    def follow(self) -> bool:
        """A rank other than 0: compute the next step rank 0 sends; False when it says stop."""
        message = self.tp.receive_step()
        if message.host is None:
            return False
        self._compute(place_step(message.host, self.tables), message.graph_size or None)
        return True

    def _compute(self, step: StepInputs, graph_size: Optional[int]) -> Optional[torch.Tensor]:
        """The step's model run on this rank: the logits of the rows that sample, None if none does."""
        if self.expert_load is not None:
            self.expert_load.mark_rows(step.slot_mapping[0])  # any group: a padding row is -1 in all
        if graph_size is not None:
            hidden = self.graphs.run(step, self.tables.table)
        else:
            hidden = self.model(step.ids, step.positions, self._step_context(step), self.rope)
        if not step.sample_index.shape[0]:
            return None
        return self.model.logits(hidden[step.sample_index])  # every rank: the LM head gathers its shards

    def moe_stats(self) -> dict:
        """Tokens per expert and the last interval's load imbalance (MoE models; else nothing)."""
        return self.expert_load.snapshot() if self.expert_load is not None else {}

    def close(self) -> None:
        """Stop the other tensor-parallel ranks (nothing to do with one rank)."""
        if self.tp is not None:
            self.tp.close()
