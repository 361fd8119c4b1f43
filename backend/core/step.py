"""The step contract: what the scheduler hands the model runner, and what the runner hands back.

Data only: the runner imports this module and nothing else of scheduling, so it never depends on
how batches are formed. No torch, no logic beyond reading its own fields.
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
    block_table: list[int] = field(default_factory=list)  # the sequence's blocks, for the runner
    # the tables of the other KV-cache groups (backend/kv/groups.py), when the model has several
    group_tables: tuple[list[int], ...] = ()
    # Speculative decoding: a verify row computes its last token and these drafts after it
    # (num_new_tokens = 1 + len(drafts)); logits are kept at each of those positions.
    draft_token_ids: list[int] = field(default_factory=list)
    draft_probs: Optional[object] = None  # the draft's q per draft ([k, V] on the device); None: point masses

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the end of the known tokens, so a new token is sampled."""
        return not self.padding and self.start + self.num_new_tokens - len(self.draft_token_ids) == self.request.num_tokens


@dataclass
class SchedulerOutput:
    """One step's batch: everything the runner needs (tokens come from the requests, blocks from
    each row's `block_table` and `group_tables`), so the runner never asks the block manager."""
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


@dataclass
class Sampled:
    """One row's result: the token and, when the request asked for logprobs, the raw numbers.
    A verify row's result is its last token, after the drafts it accepted (`accepted`)."""
    token: int
    logprob: Optional[float] = None
    rank: Optional[int] = None  # 1 = the most likely token
    top: Optional[list[tuple[int, float]]] = None  # the top k (token, logprob), best first
    accepted: list["Sampled"] = field(default_factory=list)  # accepted drafts, in order, before `token`
    num_drafts: int = 0  # drafts the row verified

    @property
    def tokens(self) -> list["Sampled"]:
        """Every token the row produced, in order: the accepted drafts, then the last."""
        return [*self.accepted, self] if self.accepted else [self]
