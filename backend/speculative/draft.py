"""Draft-model proposals: a smaller checkpoint with the target's vocabulary drafts k tokens per
sequence, one forward pass per token, run by the engine's own `ModelRunner` (its weights, its KV
cache, its block tables and, on CUDA, its decode graphs) over a `BlockManager` of its own.

Each step, for the rows the scheduler gave room (at most k drafts each):
1. one pass catches every row up (the tokens of the sequence the draft has not stored yet: the
   whole prompt the first time, then the last step's accepted tokens) and drafts d1 from the
   logits of its last token; a catch-up longer than the token budget left is chunked over steps,
   drafting nothing until it is done;
2. then one decode pass per further draft, feeding d_{j-1} to draft d_j.
The draft samples as the request does (penalties, bans, temperature, top-k, top-p): its argmax for
greedy requests and with `draft_sample_method: greedy` (point masses for the verification), or a
draw from its distribution q with `probabilistic` (q is kept for the verification).

The draft's KV is a cache, never a promise: a sequence whose blocks do not fit evicts the draft
state of sequences not drafting this step (least recently used first), or drafts nothing. After the
target's verification the draft keeps only the KV of verified tokens (`after_step`), and the state
of finished requests is dropped (`release_finished`).
"""
from __future__ import annotations

import dataclasses
import logging
import random
from typing import Optional, Sequence

import torch

from backend.core.config import EngineConfig
from backend.core.request import Request
from backend.core.speculative_config import SpeculativeConfig
from backend.core.step import NewSeq, Row, SeqUpdate, StepPlan
from backend.kv.block_manager import BlockManager
from backend.kv.groups import kv_layout
from backend.kv.sizing import TooLargeForMemory
from backend.models.loader import load_model_config
from backend.worker.runner import ModelRunner
from backend.worker.sampler import UNIFORM, filtered_probs, greedy_tokens, inverse_transform, prepare

log = logging.getLogger(__name__)


class _DraftView:
    """What the draft runner holds of each sequence (its tokens, drafts included, and its block
    table), and the plans that tell it the rest: a sequence new to it is sent whole, then only its
    token edits (the tail past the tokens it shares with the target's) and its table's new entries."""

    def __init__(self, blocks: BlockManager):
        self.blocks = blocks
        self.tokens: dict[str, list[int]] = {}
        self.tables: dict[str, tuple] = {}
        self.dropped: list[str] = []

    def describe(self, req: Request, tokens: list[int], computed: int, plan: StepPlan) -> None:
        sid, table = req.seq_id, self.blocks.block_table(req.seq_id)
        held = self.tables.get(sid)
        self.tables[sid] = (table, len(table), table[-1] if table else None)
        sent = self.tokens.get(sid)
        self.tokens[sid] = list(tokens)
        if sent is None:
            # its own random stream, apart from the target's: the verification's uniform numbers
            # must not be the ones the draft drew with
            base = req.params.seed if req.params.seed is not None else req.seed
            params = dataclasses.replace(req.params, logprobs=None, prompt_logprobs=None, seed=None)
            plan.new_seqs.append(NewSeq(sid, list(req.prompt_token_ids), tokens[req.num_prompt_tokens:], params,
                                        random.Random(f"draft:{base}").getrandbits(63), req.index, req.eos_token_ids,
                                        req.bad_words_ids, None, (list(table),), computed))
            return
        same = min(len(sent), len(tokens))
        for i in range(req.num_prompt_tokens, same):
            if sent[i] != tokens[i]:
                same = i
                break
        start = 0
        if held is not None and held[0] is table and held[1] <= len(table) and (
                held[1] == 0 or table[held[1] - 1] == held[2]):
            start = held[1]
        blocks = ((start, table[start:]),) if len(table) > start or start == 0 else ()
        plan.updates.append(SeqUpdate(sid, computed, tokens[same:], same if same < len(sent) else -1, blocks))

    def drop(self, sid: str) -> None:
        if self.tokens.pop(sid, None) is not None:
            self.dropped.append(sid)
        self.tables.pop(sid, None)

    def plan(self) -> StepPlan:
        plan = StepPlan(finished_ids=self.dropped)
        self.dropped = []
        return plan


class DraftProposer:
    def __init__(self, config: EngineConfig, spec: SpeculativeConfig, target_vocab: int, max_model_len: int,
                 target_kv_tokens: int):
        cfg = load_model_config(spec.model)
        if cfg.vocab_size != target_vocab:
            raise ValueError(f"speculative_config.model: the draft's vocabulary has {cfg.vocab_size} tokens, the "
                             f"target's {target_vocab}; a draft model must share the target's tokenizer and vocabulary")
        if spec.max_model_len > cfg.max_position_embeddings:
            raise ValueError(f"speculative_config.max_model_len ({spec.max_model_len}) exceeds what the draft "
                             f"supports ({cfg.max_position_embeddings})")
        if kv_layout(cfg.layer_windows, cfg.num_layers).num_groups > 1:  # its one BlockManager keeps one table
            raise ValueError(f"speculative_config.model: a draft whose layers form several KV-cache groups (local "
                             f"sliding-window layers beside global ones, {cfg.architecture}) is not supported")
        self.max_len = min(max_model_len, spec.max_model_len or cfg.max_position_embeddings)
        tokens = spec.draft_kv_cache_tokens or target_kv_tokens
        # the draft's own checkpoint: its weights as they come (quantization auto), no LoRA adapters
        # (they fit the target; a draft only proposes, the target's verification keeps outputs exact),
        # on rank 0's device alone under tensor parallelism (a small model: no group of its own)
        draft_config = dataclasses.replace(config, model_path=spec.model, speculative_config="", max_model_len=0,
                                           enable_kv_cache_reuse=False, max_tokens_in_paged_kv_cache=tokens,
                                           quantization="auto", enable_lora=False, lora_modules="{}",
                                           tensor_parallel_size=1)
        try:
            self.runner = ModelRunner(draft_config, cfg, self.max_len)
        except TooLargeForMemory as exc:  # the draft's cache has its own key (backend/kv/sizing.py)
            key = "speculative_config.draft_kv_cache_tokens" + ("" if spec.draft_kv_cache_tokens else
                                                                " (0: as many tokens as the target's cache)")
            raise ValueError(f"{key}: the draft model's {exc.detail}") from None
        self.blocks = BlockManager(self.runner.num_blocks, config.kv_block_size)
        self.budget = config.max_num_batched_tokens
        self.probabilistic = spec.draft_sample_method == "probabilistic"
        self.computed: dict[str, int] = {}  # tokens whose draft KV is stored, per sequence
        self.live: dict[str, Request] = {}
        self.last_used: dict[str, int] = {}
        self.clock = 0
        self.view = _DraftView(self.blocks)  # what the draft runner holds (its persistent batch)

    # -- one step -------------------------------------------------------------------------------
    def propose(self, rows: Sequence[tuple[Request, int]]) -> dict[str, tuple[list[int], Optional[torch.Tensor]]]:
        self.clock += 1
        active = {req.seq_id for req, _ in rows}
        caps: dict[str, int] = {}
        seqs: dict[str, tuple[Request, list[int]]] = {}
        plan = self.view.plan()
        budget = self.budget
        for req, cap in rows:
            sid, length = req.seq_id, req.num_tokens
            cap = min(cap, self.max_len - length + 1)  # the draft stores positions up to length + cap - 2
            start = min(self.computed.get(sid, 0), length - 1)
            if cap <= 0 or budget <= 0 or not self._make_room(sid, length + cap - 1, active):
                continue
            self.live[sid], self.last_used[sid] = req, self.clock
            n = min(length - start, budget)
            budget -= n
            tokens = req.all_token_ids
            self.view.describe(req, tokens, start, plan)
            (plan.decodes if n == 1 else plan.prefills).append(Row(sid, start, n, samples=start + n == length))
            self.computed[sid] = start + n
            if start + n == length:
                caps[sid], seqs[sid] = cap, (req, tokens)
        drafts: dict[str, list[int]] = {sid: [] for sid in caps}
        probs: dict[str, list[torch.Tensor]] = {sid: [] for sid in caps}
        while plan.rows:
            self._draft_once(plan, drafts, probs)
            plan = self.view.plan()
            for sid, (req, tokens) in seqs.items():
                if len(drafts[sid]) < caps[sid]:  # feed the last draft, to draft the next
                    tokens.append(drafts[sid][-1])
                    self.view.describe(req, tokens, len(tokens) - 1, plan)
                    plan.decodes.append(Row(sid, len(tokens) - 1, 1))
                    self.computed[sid] = len(tokens)
        if plan.finished_ids:  # (sequences dropped while drafting: told with the next plan)
            self.view.dropped = plan.finished_ids + self.view.dropped
        return {sid: (d, torch.stack(probs[sid]) if probs[sid] else None) for sid, d in drafts.items()}

    @torch.inference_mode()
    def _draft_once(self, plan: StepPlan, drafts: dict, probs: dict) -> None:
        """One draft forward pass; each row that reached its end drafts one more token."""
        logits, step = self.runner.forward(plan)
        if logits is None:
            return
        prep = prepare(logits, step.sampling)  # (a draft sequence's tokens hold its drafts so far)
        tokens = greedy_tokens(logits)
        q = None
        if self.probabilistic and prep.plan.random_rows:
            rows = prep.random_rows
            q = filtered_probs(logits[rows], prep.settings[rows], prep.plan)
            q = q / q.sum(-1, keepdim=True)
            tokens[rows] = inverse_transform(q, prep.settings[rows, UNIFORM])
        random_rows = set(prep.plan.random_rows)
        for i, (seq, token) in enumerate(zip(step.sampling, tokens.tolist())):
            drafts[seq.seq_id].append(token)
            if q is not None and i in random_rows:
                probs[seq.seq_id].append(q[prep.plan.random_rows.index(i)])

    def _make_room(self, sid: str, num_tokens: int, active: set) -> bool:
        """Blocks for sid's first num_tokens draft tokens, evicting idle sequences' draft state."""
        if self.blocks.blocks_for(num_tokens) > self.blocks.num_blocks:
            return False
        idle = sorted((t, s) for s, t in self.last_used.items() if s not in active)
        while not self.blocks.can_grow(sid, num_tokens) and idle:
            self._drop(idle.pop(0)[1])
        if not self.blocks.can_grow(sid, num_tokens):
            return False
        self.blocks.grow(sid, num_tokens)
        return True

    # -- after the target's step ----------------------------------------------------------------
    def after_step(self, out) -> None:
        """Keep only the draft KV of verified tokens: a rejected draft's slot is written again."""
        for s in out.prefills:  # verify rows (other rows only appended tokens: the draft's KV stays valid)
            sid = s.request.seq_id
            if s.draft_token_ids and sid in self.computed and not s.request.status.finished:
                self.computed[sid] = min(self.computed[sid], s.request.num_computed_tokens)
                self.blocks.trim(sid, self.computed[sid])
        self.release_finished()

    def release_finished(self) -> None:
        for sid in [sid for sid, req in self.live.items() if req.status.finished]:
            self._drop(sid)

    def reset(self) -> None:
        """Forget every sequence (after a failed draft pass: its KV state is unknown)."""
        for sid in list(self.live):
            self._drop(sid)

    def _drop(self, sid: str) -> None:
        self.blocks.free(sid)
        self.view.drop(sid)
        for table in (self.computed, self.live, self.last_used):
            table.pop(sid, None)

    def check_integrity(self) -> None:
        """The draft's blocks are sound and held by live sequences only, each covering its KV."""
        self.blocks.check_integrity()
        held = sum(self.blocks.num_blocks_of(sid) for sid in self.live)
        assert self.blocks.num_held == held, f"draft blocks: {self.blocks.num_held} held, {held} by live sequences"
        for sid in self.live:
            assert self.blocks.num_blocks_of(sid) * self.blocks.block_size >= self.computed.get(sid, 0), sid
