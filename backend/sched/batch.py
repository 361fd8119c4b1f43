"""The scheduler's batch: one step's rows over live requests, as the scheduler forms it, the
speculator adds drafts to it and the scheduler's update reads it back. It never leaves the
scheduler's side: the worker gets the step plan made from it (step_plan.py, backend/core/step.py).
No torch, no logic beyond reading its own fields.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from backend.core.request import Request


@dataclass
class ScheduledSeq:
    request: "Request"
    start: int  # first position computed this step
    num_new_tokens: int
    padding: bool = False  # a padding row: computed for its cost only, never stored nor sampled
    # Speculative decoding: a verify row computes its last token and these drafts after it
    # (num_new_tokens = 1 + len(drafts)); logits are kept at each of those positions.
    draft_token_ids: list[int] = field(default_factory=list)
    draft_probs: Optional[object] = None  # the draft's q per draft ([k, V] on the device); None: point masses
    taken: int = -1  # the sampled tokens postprocess appended (-1: none looked at: it had ended)

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the end of the known tokens, so a new token is sampled."""
        return not self.padding and self.start + self.num_new_tokens - len(self.draft_token_ids) == self.request.num_tokens


@dataclass
class SchedulerOutput:
    """One step's batch over live requests (the worker gets the plan made from it)."""
    decodes: list[ScheduledSeq] = field(default_factory=list)  # one query token each
    prefills: list[ScheduledSeq] = field(default_factory=list)  # chunks of several tokens
    preempted: list["Request"] = field(default_factory=list)
    # Padded batches only: rows computed for their cost, attending to their member's cached context
    # from `start` on; never stored (slot -1), never sampled.
    padding: list[ScheduledSeq] = field(default_factory=list)
    spare_tokens: int = 0  # the token budget left after forming the batch: drafts may use it

    @property
    def seqs(self) -> list[ScheduledSeq]:
        """The real rows (padding excluded)."""
        return self.decodes + self.prefills

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.seqs + self.padding)

    @property
    def is_empty(self) -> bool:
        return not self.decodes and not self.prefills and not self.padding

    def add(self, req: "Request", n: int) -> None:
        """A row computing req's next n tokens: a decode row for one, a prefill chunk for more."""
        seq = ScheduledSeq(req, req.num_computed_tokens, n)
        (self.decodes if n == 1 else self.prefills).append(seq)

    def drop(self, req: "Request") -> int:
        """Remove req's rows (it was preempted after they were formed); returns their tokens."""
        freed = 0
        for rows in (self.decodes, self.prefills):
            freed += sum(s.num_new_tokens for s in rows if s.request is req)
            rows[:] = [s for s in rows if s.request is not req]
        return freed
