"""The engine's speculative decoding, step by step: which rows speculate, their proposals, and the
counts the metrics report. One step is still schedule -> run -> postprocess:

- after `schedule()`: `propose(batch)`. Unless the step runs more sequences than
  `disable_by_batch_size`, every decode row of an unconstrained request (structured outputs never
  speculate: their grammar would have to follow and roll back every draft) is offered drafts; the
  scheduler says how many each may have (`draft_room`: the spare token budget, the tokens the
  request may still generate, free blocks), the proposer proposes, and the scheduler turns the
  rows that got drafts into verify rows (`attach_drafts`);
- `runner.run(batch)` verifies them in the same forward pass as the other rows (rejection.py);
- after `postprocess()`: `after_step(batch, sampled)` counts drafts and accepted tokens and lets the
  draft model keep only the KV of verified tokens.
A failure of the proposer costs only its drafts: the step runs without them.
"""
from __future__ import annotations

import logging
from typing import Mapping, Optional, Sequence

from backend.core.request import Request
from backend.sched.batch import SchedulerOutput
from backend.core.speculative_config import SpeculativeConfig
from backend.speculative.ngram import NgramProposer

log = logging.getLogger(__name__)


class NgramDrafts:
    """The n-gram proposer behind the proposers' interface (it keeps no state between steps)."""

    def __init__(self, spec: SpeculativeConfig):
        self.ngram = NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)

    def propose(self, rows: Sequence[tuple[Request, int]]) -> dict[str, tuple[list[int], None]]:
        return {req.seq_id: (self.ngram.propose(req.all_token_ids, cap), None) for req, cap in rows}

    def after_step(self, out: SchedulerOutput) -> None:
        pass

    def release_finished(self) -> None:
        pass

    def reset(self) -> None:
        pass

    def check_integrity(self) -> None:
        pass


class Speculator:
    def __init__(self, spec: SpeculativeConfig, scheduler, proposer):
        self.spec = spec
        self.k = spec.num_speculative_tokens
        self.scheduler = scheduler
        self.proposer = proposer
        self.num_draft_tokens = 0  # drafts verified
        self.num_accepted_tokens = 0  # of them, accepted
        self.acceptance_lengths = [0] * (self.k + 1)  # verify rows by tokens emitted (1 .. k + 1)
        # proposals that raised: the step ran without drafts, so outputs stay right and only speed
        # is lost; counted (and exported) so that a proposer broken for some requests shows
        self.num_failed_proposals = 0

    @classmethod
    def create(cls, config, scheduler, vocab_size: int, max_model_len: int, target_kv_tokens: int) -> Optional["Speculator"]:
        spec = config.speculative
        if spec is None:
            return None
        if spec.method == "ngram":
            return cls(spec, scheduler, NgramDrafts(spec))
        from backend.speculative.draft import DraftProposer  # loads a second model: only when asked
        return cls(spec, scheduler, DraftProposer(config, spec, vocab_size, max_model_len, target_kv_tokens))

    def propose(self, out: SchedulerOutput) -> int:
        """Offer this step's decode rows drafts; returns how many were attached."""
        if not self.spec.enabled_for(len(out.seqs)):
            return 0
        rows = [s for s in out.decodes if s.samples and s.request.grammar is None]
        room = self.scheduler.draft_room(out, rows, self.k) if rows else {}
        if not room:
            return 0
        try:
            drafts = self.proposer.propose([(s.request, room[s.request.seq_id]) for s in rows
                                            if s.request.seq_id in room])
        except Exception:  # drafts are optional: the step runs without them
            self.num_failed_proposals += 1
            log.exception("speculative proposal failed (%d so far); this step runs without drafts",
                          self.num_failed_proposals)
            self.proposer.reset()
            drafts = {}
        return self.scheduler.attach_drafts(out, room, drafts)

    def after_step(self, out: SchedulerOutput, sampled: Mapping[str, object]) -> None:
        for s in out.prefills:
            result = sampled.get(s.request.seq_id)
            if s.draft_token_ids and result is not None:
                self.num_draft_tokens += result.num_drafts
                self.num_accepted_tokens += len(result.accepted)
                self.acceptance_lengths[len(result.accepted)] += 1
        self.proposer.after_step(out)

    def release_finished(self) -> None:
        self.proposer.release_finished()

    def stats(self) -> dict:
        return {"spec_decode_num_draft_tokens": self.num_draft_tokens,
                "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
                "spec_decode_num_failed_proposals": self.num_failed_proposals,
                "spec_decode_acceptance_lengths": list(self.acceptance_lengths)}

    def check_integrity(self) -> None:
        self.proposer.check_integrity()
