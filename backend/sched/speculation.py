"""Room for speculative drafts in a formed batch, drafts turned into verify rows, and the blocks
of rejected drafts given back. No torch here.

Drafts come last. The batch is formed exactly as without speculation (running rows, then
admission, with every rule of scheduler.py, admission.py and backfill.py: priority, backfill and
the head's held token are untouched), and drafts get only what is left after it:
- tokens: the budget the batch left unused (`SchedulerOutput.spare_tokens`);
- length: a sequence never gets more drafts than tokens it may still generate, less the one the
  verify step samples itself, so it never exceeds max_tokens or max_model_len. Under
  `guaranteed_no_evict` this keeps every position a verify row writes within the blocks reserved
  for the request to completion (prompt + max_tokens - 1 tokens): the reservation covers the
  lookahead and free blocks always cover it, so speculation never makes anyone wait for blocks;
- blocks: only free ones, taken now. Under `max_utilization` a row whose drafts do not fit gets
  fewer drafts (none at worst); nobody is preempted for a draft.
After the step the scheduler gives back the blocks past the verified tokens (`BlockManager.trim`).
"""
from __future__ import annotations

from typing import Mapping, Optional, Sequence

from backend.block_manager import BlockManager
from backend.sched.step import ScheduledSeq, SchedulerOutput


def draft_room(out: SchedulerOutput, blocks: BlockManager, rows: Sequence[ScheduledSeq], k: int,
               max_model_len: int) -> dict[str, int]:
    """How many drafts each decode row of `rows` (in order) may have verified this step, at most k;
    the blocks for them are taken now. Rows left out get none."""
    spare = out.spare_tokens
    room: dict[str, int] = {}
    for s in rows:
        if spare <= 0:
            break
        req = s.request
        length = req.num_tokens  # the row computes position length - 1; drafts follow it
        cap = min(k, spare, req.params.max_tokens - len(req.output_token_ids) - 1, max_model_len - length - 1)
        held = blocks.num_blocks_of(req.seq_id)
        while cap > 0 and blocks.blocks_for(length + cap) - held > blocks.num_free_blocks:
            cap -= 1  # max_utilization with blocks short: fewer drafts, never a preemption
        if cap <= 0:
            continue
        blocks.grow(req.seq_id, length + cap)
        room[req.seq_id] = cap
        spare -= cap
    return room


def attach_drafts(out: SchedulerOutput, blocks: BlockManager, room: Mapping[str, int],
                  drafts: Mapping[str, tuple[list[int], Optional[object]]]) -> int:
    """Turn each decode row that got drafts into a verify row (1 + drafts tokens, among the
    multi-token rows) and give back the blocks its proposal left unused. Returns the drafts
    attached."""
    attached = 0
    for s in list(out.decodes):
        sid = s.request.seq_id
        if sid not in room:
            continue
        tokens, probs = drafts.get(sid, ([], None))
        tokens = list(tokens[:room[sid]])
        blocks.trim(sid, s.request.num_tokens + len(tokens))
        if tokens:
            s.draft_token_ids = tokens
            s.draft_probs = probs
            s.num_new_tokens = 1 + len(tokens)
            out.decodes.remove(s)
            out.prefills.append(s)
            attached += len(tokens)
        s.block_table = blocks.block_table(sid)
    out.spare_tokens -= attached
    return attached
