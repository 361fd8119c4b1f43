"""Speculation on a scheduler with no model (for the scheduler property tests): each step the
decode rows get random drafts within the room the scheduler gives, a random prefix of them is
accepted, and every invariant of a verify step is checked on the way."""
from __future__ import annotations

import random

from backend.core.step import Sampled


def speculative_step(sched, rng: random.Random, k: int, eos: int, eos_rate: float = 0.0, now: float = 0.0,
                     accept_rate: float = 0.6, token_range: tuple[int, int] = (1, 100)):
    """schedule -> drafts -> (fake) verification -> postprocess; returns the SchedulerOutput."""
    out = sched.schedule(now)
    budget = sched.config.max_num_batched_tokens
    preemptions = sched.num_preemptions
    rows = [s for s in out.decodes if s.samples]
    room = sched.draft_room(out, rows, k)
    assert all(1 <= n <= k for n in room.values())
    drafts = {sid: ([rng.randrange(*token_range) for _ in range(rng.randint(0, n))], None) for sid, n in room.items()}
    sched.attach_drafts(out, room, drafts)
    assert sched.num_preemptions == preemptions, "a draft preempted a request"
    assert out.num_batched_tokens <= budget
    bs = sched.blocks.block_size
    for s in out.seqs:  # blocks cover every position computed this step, drafts included
        assert sched.blocks.num_blocks_of(s.request.seq_id) * bs >= s.start + s.num_new_tokens
        req = s.request
        if s.draft_token_ids:  # never past max_tokens, never past max_model_len
            assert len(req.output_token_ids) + len(s.draft_token_ids) + 1 <= req.params.max_tokens
            assert req.num_tokens + len(s.draft_token_ids) + 1 <= sched.max_model_len
    sampled = {}
    for s in out.seqs:
        if not s.samples:
            continue
        accepted = 0
        while accepted < len(s.draft_token_ids) and rng.random() < accept_rate:
            accepted += 1
        last = eos if rng.random() < eos_rate else rng.randrange(*token_range)
        sampled[s.request.seq_id] = Sampled(last, accepted=[Sampled(t) for t in s.draft_token_ids[:accepted]],
                                            num_drafts=len(s.draft_token_ids))
    sched.postprocess(out, sampled, now)
    for s in out.seqs:  # rejected drafts' blocks given back: a verify row holds what a plain row would
        req = s.request
        if s.draft_token_ids and not req.status.finished:
            assert req.num_computed_tokens == req.num_tokens - 1
            assert sched.blocks.num_blocks_of(req.seq_id) == sched.blocks.blocks_for(req.num_computed_tokens)
    return out
