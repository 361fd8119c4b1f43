"""The model runner: the worker's one object, the only one that touches torch devices.

It loads the weights, owns the paged KV cache tensors and the persistent batch of the sequences it
was told of (input_batch.py), and runs each step's plan (backend/core/step.py): deltas applied to
the batch, KV tiers' copies made, flat inputs built (step_inputs.py) with image rows (vision.py) and
M-RoPE positions (mrope_step.py), the model run (decode steps on fast_paths.py's CUDA graphs or C
stack), rows sampled (sample_step.py). On CUDA it binds its device to the engine thread; holding the
GPU's lock (memory.py) it loads the weights, warms up, sizes the KV cache and captures the graphs.

With tensor_parallel_size N (worker/parallel/) rank 0's runner starts the group: it holds its shard
of every layer and of the KV cache, sends each step's plan to the other ranks as one message
(`forward`) and samples from the gathered logits; every other rank's runner loads its own shard the
same way, applies the same plans to its own batch and computes the same steps (`follow`).
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Optional

import torch

from backend.core.config import EngineConfig
from backend.core.step import StepPlan, StepResult
from backend.kv.groups import kv_layout
from backend.kv.sizing import blocks_that_fit, check_block_tables, check_kv_cache, kv_bytes_per_token
from backend.models.expert_load import ExpertLoad
from backend.models.llama import LlamaForCausalLM
from backend.models.loader import ModelConfig
from backend.models.rope import rope_tables
from backend.models.weights import compute_dtype, kv_cache_dtype, load_model
from backend.worker import fast_paths, memory, mrope_step, pooler, prompt_logprobs
from backend.worker.attention_metadata import AttentionMetadata
from backend.worker.block_copy import copy_blocks
from backend.worker.cpu_affinity import set_cpu_threads
from backend.worker.cpu_memory import keep_freed_memory
from backend.worker.cuda_graphs import DecodeGraphs
from backend.worker.device import DeviceEnv, resolve_device, resolve_dtype
from backend.worker.input_batch import BlockTables, InputBatch
from backend.worker.kv_copier import KVCopier
from backend.worker.lora.manager import make_lora_manager
from backend.worker.parallel.vision import vision_step
from backend.worker.parallel.rendezvous import start_group
from backend.worker.sample_step import sample_step
from backend.worker.step_inputs import StepInputs, build_step
from backend.worker.warmup import prefill_tokens, warm_up_steps
from kernels.cpu import huge_pages
from kernels.dispatch import get_ops

log = logging.getLogger(__name__)
__all__ = ["ModelRunner", "kv_bytes_per_token"]


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
            set_cpu_threads(self.tp.rank if self.tp else 0, self.tp.size if self.tp else 1)
            keep_freed_memory()  # no page faults on every step's fresh activations (cpu_memory.py)
        self.dtype = resolve_dtype(config.dtype, model_cfg.torch_dtype, self.device,
                                   keep_on_cpu=model_cfg.keeps_dtype_on_cpu)
        self.ops = get_ops(config.attention_backend, self.device, compute_dtype(self.dtype, self.device))
        self.block_size = config.kv_block_size
        self.kv_layout = kv_layout(model_cfg.layer_windows, model_cfg.num_layers)  # backend/kv/groups.py
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.decode_path = fast_paths.DecodePath()
        self.kv_copier: Optional[KVCopier] = None  # the KV tiers' host pool and copies, when on
        self._unsent: list[StepPlan] = []  # tensor parallelism: empty plans the other ranks have not seen
        self.metadata = AttentionMetadata(self.ops, model_cfg, self.kv_layout, max_model_len, self.block_size,
                                          self.env.tensor_device)
        with memory.one_engine_at_a_time(self.env):  # engines on one GPU load and size one after another
            self.model = self._load_model()
            self.vision = vision_step(config, self.tp, self.env.tensor_device, self.ops.name == "cpu")
            self.lora = make_lora_manager(config, self.whole_model_cfg, self.model, self.ops.name,
                                          self.env.tensor_device, tp=self.tp)
            self.rope = rope_tables(model_cfg, max_model_len, self.env.tensor_device)
            width = -(-max_model_len // self.block_size)
            check_block_tables(config, width, memory.available_bytes(self.env), self.kv_layout.num_groups)
            self.batch = InputBatch(BlockTables(config.max_num_seqs, width, self.block_size, self.env.tensor_device,
                                                groups=self.kv_layout.num_groups))
            self.num_blocks = self._num_kv_blocks()
            if self.tp:  # the scheduler sees one engine: the group holds what its smallest rank holds
                self.num_blocks = self.tp.smallest(self.num_blocks)
            if not (self.env.is_cuda and config.max_tokens_in_paged_kv_cache == 0):  # else sized to what is free
                check_kv_cache(config, self.num_blocks, self._bytes_per_block(), memory.available_bytes(self.env))
            self.kv_caches = self._allocate_kv(self.num_blocks)
            self.decode_path = fast_paths.choose(config, self.model, self.ops.name, self.tp, self.lora, self._graphs)
        if self.expert_load is not None:
            self.expert_load.reset()
        graphs = self.decode_path.graphs
        log.info("KV cache: %d blocks of %d tokens (%.1f MiB) on %s; kernels: %s; CUDA graphs: %s", self.num_blocks,
                 self.block_size, self.num_blocks * self._bytes_per_block() / 2**20, self.device, self.ops.name,
                 bool(graphs and graphs.graphs))

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
        if self.env.tensor_device.type == "cpu":  # read every decode step: in 2 MB pages (kernels/cpu/huge_pages.py)
            zeros = lambda: huge_pages.zeros(shape, self.kv_dtype)  # noqa: E731
        else:
            zeros = lambda: torch.zeros(shape, dtype=self.kv_dtype, device=self.env.tensor_device)  # noqa: E731
        pairs = [(zeros(), zeros()) for _ in range(layout.slots)]
        return [pairs[slot] for slot in layout.layer_slot]

    def _warm_up(self) -> None:
        """backend/worker/warmup.py's steps through execute(), on a throwaway cache."""
        cfg = self.config
        n = prefill_tokens(cfg.max_num_batched_tokens, self.max_model_len)
        self.kv_caches = self._allocate_kv(-(-n // self.block_size) + 1)
        try:
            for plan in warm_up_steps(cfg.max_num_batched_tokens, cfg.max_num_seqs, self.max_model_len,
                                      self.block_size, self.model_cfg.vocab_size, self.kv_layout.num_groups):
                self.execute(plan)
        finally:
            self.kv_caches = []
            self.batch.reset()

    def _graphs(self) -> DecodeGraphs:
        return DecodeGraphs(self.env, self.config.max_num_seqs, self.batch.tables.width,
                            self.metadata.for_graphs(self.kv_caches, self.batch.tables.table), self.model, self.rope,
                            groups=self.kv_layout.num_groups)

    # -- KV tiers (backend/kv/tiers/): the host pool, and a step's copies before its model run ----
    def attach_kv_copier(self, host_bytes: int) -> KVCopier:
        """The host pool and its copies to and from this runner's KV cache (kv_copier.py): each
        step's plan carries the tiers' copies, made before the step's model run."""
        self.kv_copier = KVCopier(self.env, self.kv_caches, host_bytes)
        return self.kv_copier

    def prefill_context(self, num_tokens: int):
        """The context of one sequence's prefill of num_tokens tokens on a throwaway cache of its own
        (client/tools/quality/perplexity.py scores texts this way)."""
        blocks = -(-num_tokens // self.block_size) * self.kv_layout.num_groups
        return self.metadata.for_prefill(num_tokens, self._allocate_kv(blocks))

    # -- one step --------------------------------------------------------------------------------
    def execute(self, plan: StepPlan) -> StepResult:
        """Run one step's plan; returns what every sampling sequence produced, by seq_id, the handle
        of the step's KV-tier copies and, for a mixture of experts, its tally. On a tensor-parallel
        rank other than 0 (the warm-up's steps) it computes the step rank 0 sends instead."""
        result = self._execute(plan)
        if self.expert_load is not None and not plan.is_empty:  # (read outside inference mode: it keeps them)
            result.expert_tally = self.expert_load.snapshot()
        return result

    @torch.inference_mode()
    def _execute(self, plan: StepPlan) -> StepResult:
        if self.tp and self.tp.rank:
            self.follow()
            return StepResult()
        copies = self.kv_copier.execute(plan.kv_copies) if plan.kv_copies else None
        copy_blocks(self.kv_caches, plan.block_copies)  # beam search's copy-on-write, before any write
        if plan.is_empty:  # no row: only what the worker holds changes
            self.batch.apply(plan)
            if self.tp and (plan.finished_ids or plan.preempted_ids):
                self._unsent.append(plan)  # the other ranks learn it with the next step they run
            return StepResult(kv_copies=copies)
        logits, step = self.forward(plan)
        if logits is None or not step.sampling:
            return StepResult(step.pooled, kv_copies=copies)  # (pooling rows are answered, never sampled)
        sampled = sample_step(logits, step, plan.grammar)
        if step.prompt_rows:
            prompt_logprobs.hand_over(step.prompt_rows, sampled)
        return StepResult({**sampled, **step.pooled}, copies)

    @torch.inference_mode()
    def forward(self, plan: StepPlan) -> tuple[Optional[torch.Tensor], StepInputs]:
        """The model run of a plan: the logits of the positions that sample (None if none does)."""
        self.batch.apply(plan)
        size = self.decode_path.graph_size(plan)
        lora_plan = None
        if self.tp:  # every rank applies the same plan; the LoRA slots are rank 0's choice
            lora_plan = self._lora_plan(plan, size)
            self.tp.send_step(self._with_unsent(plan), size or 0, lora_plan)
        step = build_step(plan, self.batch, self._empty_rows(plan, size), verify_as_decode=self.ops.name == "cpu",
                          lora=self.lora, lora_plan=lora_plan)
        step.images = self.vision and self.vision.prepare(plan, self.batch, self._empty_rows(plan, size))
        step.rope = mrope_step.step_rope(self, plan, step, self._empty_rows(plan, size))  # Qwen2.5-VL: M-RoPE
        return self._compute(step, size), step

    def _with_unsent(self, plan: StepPlan) -> StepPlan:
        """The plan for the other ranks, with what empty plans since the last sent one changed."""
        if not self._unsent:
            return plan
        earlier, self._unsent = self._unsent, []
        return dataclasses.replace(plan, finished_ids=[i for p in earlier for i in p.finished_ids] + plan.finished_ids,
                                   preempted_ids=[i for p in earlier for i in p.preempted_ids] + plan.preempted_ids)

    def _empty_rows(self, plan: StepPlan, graph_size: Optional[int]) -> int:
        if graph_size is not None:
            return graph_size - len(plan.decodes) - len(plan.padding)
        tokens = plan.num_batched_tokens
        return self.padded_rows(tokens) - tokens

    def _lora_plan(self, plan: StepPlan, graph_size: Optional[int]) -> tuple:
        """Rank 0's LoRA runs by slot and slot writes for a plan (the other ranks follow them)."""
        if self.lora is None:
            return [], []
        from backend.worker.lora.segments import adapter_runs
        from backend.worker.step_inputs import step_rows
        decodes, prefills = step_rows(plan, self.batch, self.ops.name == "cpu")
        return self.lora.assign(adapter_runs(self._empty_rows(plan, graph_size), decodes + prefills,
                                             lambda r: self.batch.seqs[r.seq_id].lora_name))

    @torch.inference_mode()
    def follow(self) -> bool:
        """A rank other than 0: compute the next step rank 0 sends; False when it says stop."""
        message = self.tp.receive_step()
        if message.plan is None:
            return False
        plan, size = message.plan, message.graph_size or None
        copy_blocks(self.kv_caches, plan.block_copies)
        self.batch.apply(plan)
        step = build_step(plan, self.batch, self._empty_rows(plan, size), verify_as_decode=self.ops.name == "cpu",
                          lora=self.lora, lora_plan=message.lora)
        self._compute(self.vision.attach(step, plan, self.batch, self._empty_rows(plan, size)) if self.vision else step, size)
        return True

    def _compute(self, step: StepInputs, graph_size: Optional[int]) -> Optional[torch.Tensor]:
        """The step's model run on this rank: the logits of the rows that sample, None if none does."""
        if self.expert_load is not None:
            self.expert_load.mark_rows(step.slot_mapping[0])  # any group: a padding row is -1 in all
        if graph_size is not None:
            hidden = self.decode_path.graphs.run(step, self.batch.tables.table)
        else:
            lora = self.lora.step(step.lora_runs, step.lora_writes, step.ids.shape[0]) if self.lora is not None else None
            ctx = self.metadata.for_step(step, self.batch.tables.table, self.kv_caches, lora)
            rope = getattr(step, "rope", None)  # image rows (Qwen2.5-VL): the step's own tables, the Python layers
            stack = None if rope else self.decode_path.stack_for(step.num_decode_rows, step.ids.shape[0])
            hidden = self.model(step.ids, step.positions, ctx, rope or self.rope, decode_stack=stack)
        pooler.read_hidden(step, hidden, self.model)  # prompt logprobs' positions, pooling rows
        if not step.sample_index.shape[0]:
            return None
        return self.model.logits(hidden[step.sample_index])  # every rank: the LM head gathers its shards

    def close(self) -> None:
        """Stop the other tensor-parallel ranks (nothing to do with one rank)."""
        if self.tp is not None:
            self.tp.close()
