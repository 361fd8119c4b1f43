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
- blocks: only free ones, counted when the room is given and taken when the proposed drafts are
  attached. Under `max_utilization` a row whose drafts do not fit gets fewer drafts (none at
  worst); nobody is preempted for a draft.
After the step the scheduler gives back the blocks past the verified tokens (`KVCacheGroups.trim`).
"""
from __future__ import annotations

from typing import Mapping, Optional, Sequence

from backend.kv.groups import KVCacheGroups
from backend.sched.batch import ScheduledSeq, SchedulerOutput


def draft_room(out: SchedulerOutput, blocks: KVCacheGroups, rows: Sequence[ScheduledSeq], k: int,
               max_model_len: int) -> dict[str, int]:
    """How many drafts each decode row of `rows` (in order) may have verified this step, at most k.
    Rows left out get none. Nothing is taken yet: the blocks are counted here and taken by
    `attach_drafts` for the drafts actually proposed (a row with no proposal costs nothing, and
    cached prefix blocks on the free list stay cached)."""
    spare = out.spare_tokens
    free = blocks.num_free_blocks
    room: dict[str, int] = {}
    for s in rows:
        if spare <= 0:
            break
        req = s.request
        length = req.num_tokens  # the row computes position length - 1; drafts follow it
        cap = min(k, spare, req.params.max_tokens - len(req.output_token_ids) - 1, max_model_len - length - 1)
        while cap > 0 and blocks.extra_blocks_needed(req.seq_id, length + cap) > free:
            cap -= 1  # max_utilization with blocks short: fewer drafts, never a preemption
        if cap <= 0:
            continue
        room[req.seq_id] = cap
        spare -= cap
        free -= blocks.extra_blocks_needed(req.seq_id, length + cap)
    return room


def attach_drafts(out: SchedulerOutput, blocks: KVCacheGroups, room: Mapping[str, int],
                  drafts: Mapping[str, tuple[list[int], Optional[object]]]) -> int:
    """Turn each decode row that got drafts into a verify row (1 + drafts tokens, among the
    multi-token rows), with the blocks its drafts need. Returns the drafts attached."""
    attached = 0
    for s in list(out.decodes):
        sid = s.request.seq_id
        tokens, probs = drafts.get(sid, ([], None)) if sid in room else ([], None)
        tokens = list(tokens[:room.get(sid, 0)])
        if not tokens:
            continue
        blocks.grow(sid, s.request.num_tokens + len(tokens))  # counted by draft_room: they fit
        s.draft_token_ids = tokens
        s.draft_probs = probs
        s.num_new_tokens = 1 + len(tokens)
        out.decodes.remove(s)
        out.prefills.append(s)
        attached += len(tokens)
    out.spare_tokens -= attached
    return attached
