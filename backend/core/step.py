"""The step contract: what the scheduler sends the worker each step (`StepPlan`), and what the worker
answers (`StepResult`). Data only, by sequence id: no live request crosses it, so it can be
pickled and sent as it is to every tensor-parallel rank (backend/worker/parallel/step_message.py).

A sequence is described in full once, when the worker first meets it (`NewSeq`: its prompt, its
sampling settings and random seed, its adapter, its block tables, its computed count); afterwards
the plan carries only what changed since the worker last saw it (`SeqUpdate`: the tokens appended,
the computed count, the block-table entries written). The worker keeps every sequence it was told
of (backend/worker/input_batch.py) until the plan lists it as finished; a preempted sequence
keeps its tokens and random stream there, loses its blocks, and comes back as `resumed`.
After vLLM v1's SchedulerOutput (new requests once, then deltas by id) and its persistent batch.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    from backend.core.sampling_params import SamplingParams

BlockDelta = tuple[int, list[int]]  # (first entry written, the entries from there on): a table's new tail


@dataclass
class NewSeq:
    """A sequence the worker has not seen: everything it needs to run and sample it."""
    seq_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    params: "SamplingParams"
    seed: int  # its random stream (core/request.py `sampling_stream`, with `index`)
    index: int  # which of its request's n completions
    eos_token_ids: tuple[int, ...]
    bad_words_ids: list[list[int]]
    lora_name: Optional[str]
    block_tables: tuple[list[int], ...]  # one per KV-cache group (backend/kv/groups.py)
    num_computed_tokens: int
    pooling: Optional[str] = None  # a pooling request's (docs/pooling.md): last | mean | cls; None samples
    # its images (backend/core/multimodal.py ImageItem: placeholder run, pixels, hash; docs/vision.md)
    mm_items: tuple = ()


@dataclass
class SeqUpdate:
    """What changed of a sequence the worker holds, since the plan that last named it."""
    seq_id: str
    num_computed_tokens: int
    new_token_ids: list[int] = field(default_factory=list)  # appended to its tokens
    tokens_from: int = -1  # >= 0: its tokens are cut to this many before the new ones (a draft runner's)
    blocks: tuple[BlockDelta, ...] = ()  # per KV-cache group; () when no table changed
    resumed: bool = False  # back after a preemption: its tables are new (their deltas start at 0)


@dataclass
class Row:
    """One row of the step's flat batch: `num_new_tokens` of a sequence from position `start`."""
    seq_id: str
    start: int
    num_new_tokens: int
    samples: bool = True  # the row reaches the end of the known tokens: a token is sampled
    padding: bool = False  # a padded batch's row: computed for its cost, never stored nor sampled
    # Speculative decoding: a verify row computes its last token and these drafts after it
    # (num_new_tokens = 1 + len(drafts)); logits are kept at each of those positions.
    draft_token_ids: list[int] = field(default_factory=list)
    draft_probs: Optional[Any] = None  # the draft's q per draft ([k, V] on the device); None: point masses


@dataclass
class GrammarMasks:
    """Structured outputs: the token bitmask of each constrained row that samples this step
    (xgrammar's layout, int32 words [rows, ceil(vocab / 32)]), in `seq_ids` order."""
    seq_ids: list[str]
    bitmask: Any  # numpy int32


@dataclass
class StepPlan:
    """One step for the worker (and every tensor-parallel rank)."""
    new_seqs: list[NewSeq] = field(default_factory=list)
    updates: list[SeqUpdate] = field(default_factory=list)
    decodes: list[Row] = field(default_factory=list)  # one query token each
    prefills: list[Row] = field(default_factory=list)  # chunks of several tokens, verify rows
    padding: list[Row] = field(default_factory=list)
    finished_ids: list[str] = field(default_factory=list)  # the worker forgets these
    preempted_ids: list[str] = field(default_factory=list)  # their blocks are gone; state kept
    grammar: Optional[GrammarMasks] = None
    kv_copies: Optional[Any] = None  # the KV tiers' TierPlan (backend/kv/tiers/plan.py), made first
    # (source, destination) blocks copied in every KV tensor before the step runs: a beam that took
    # another's history copies its partly filled last block before writing it (backend/sched/beams.py)
    block_copies: list[tuple[int, int]] = field(default_factory=list)

    @property
    def rows(self) -> list[Row]:
        """The real rows (padding excluded)."""
        return self.decodes + self.prefills

    @property
    def num_batched_tokens(self) -> int:
        return sum(r.num_new_tokens for r in self.decodes + self.prefills + self.padding)

    @property
    def is_empty(self) -> bool:
        return not self.decodes and not self.prefills and not self.padding


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
    # With a request's first token, when it asked for prompt_logprobs: per prompt position 1..
    # (logprob, rank, top) of that prompt token (backend/worker/prompt_logprobs.py)
    prompt_logprobs: Optional[list] = None
    # A pooling sequence's answer instead of a token (`token` is -1): its pooled hidden state after
    # the final norm, or its score head's logits (backend/worker/pooler.py), as floats
    pooled: Optional[list[float]] = None

    @property
    def tokens(self) -> list["Sampled"]:
        """Every token the row produced, in order: the accepted drafts, then the last."""
        return [*self.accepted, self] if self.accepted else [self]


@dataclass
class StepResult:
    """The worker's answer: what each sampling sequence produced, by seq_id, the handle of the
    step's KV-tier copies (None: done already, as on the CPU), and a mixture of experts' tally
    (tokens per expert, the load imbalance since the last one; {} for a dense model)."""
    sampled: dict[str, Sampled] = field(default_factory=dict)
    kv_copies: Optional[Any] = None
    expert_tally: dict = field(default_factory=dict)
