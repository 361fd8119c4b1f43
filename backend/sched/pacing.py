"""Prefill pacing: while requests decode, a step's prompt tokens are capped so that the step stays
within an inter-token target (docs/design.md, "Scheduling"; issue 45). No torch here.

A long prompt entering an in-flight batch used to take a whole `max_num_batched_tokens` chunk in
one step, and every decoding stream waited for it (on this project's CPU, 2,048 prompt tokens of
SmolLM2 are ~3 s: 3 s between two tokens of every stream). The pacer caps the prompt tokens of a
step that has decode rows, from the engine's own measurements, the step model (step_cost.py):

- `Pacer.prefill_cap(rows, start, kv)`: the most prompt tokens a step with `rows` decode rows
  (reading `kv` positions) may take so that its predicted time stays within the target. The target
  is `inter_token_target_ms` when that is > 0; by default (-1, "auto") it is
  `inter_token_auto_factor` x the predicted time of the decode rows alone, so that pacing means the
  same on every device; 0 turns pacing off.
- The floor: whatever the target, a step with prompt work takes at least the prompt tokens that cost
  `FLOOR_SHARE` (2/3) of the rest of the step (its decode rows and the fixed price of prompt rows),
  and at least one: a prompt always moves even when the decode rows alone exceed the target (no
  starvation), and at no less than ~1/2.5 of the speed it would have alone (a paced step is at least
  40% prompt tokens). Where the target leaves more room the target governs. Steps without decode
  rows are not capped.

Until the model has seen a step with prompt tokens it cannot price one, and does not cap (in an
engine the decoding requests' own prompts were such steps). Then it starts slow: a paced chunk is at
most `PROBE_TOKENS`, and at most twice the largest chunk whose step the model priced within
`TRUST_SLACK` (halved after a step it priced too low), because a model fitted on whole prompts
alone can misprice a small chunk beside decode rows by seconds. But a chunk whose tokens cost no
more than the step's fixed price of prompt rows is always allowed: where that price dominates (a
GPU's eager launches, ~7 ms against ~3 us a token on the first H200: ~2,000 tokens) a small chunk
is nearly as long a step as a whole one, and slow-starting there made a paced prompt ~100 steps and
5-36x its time alone; the CPU's fixed price of 0-2 ms allows a token or two. (Only up to the largest
prompt chunk without decode rows that the model priced within `ALONE_SLACK`: a fit that priced tokens at
nothing would otherwise allow any chunk.) The no-evict guarantee
is untouched: the pacer only says how many tokens run in a step, never who holds blocks.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from backend.sched.step_cost import StepCost, batch_shape, step_features

if TYPE_CHECKING:
    from backend.sched.batch import SchedulerOutput

FLOOR_SHARE = 2 / 3       # a paced step's prompt tokens cost at least this share of the rest of the step
PROBE_TOKENS = 16         # the largest paced chunk before the model has priced one beside decode rows
TRUST_SLACK = 1.25        # a paced step within this factor of its predicted time vouches for the model
ALONE_SLACK = 2.0         # a prompt's step without decode rows within this factor vouches for its tokens' price


class Pacer:
    """How many prompt tokens a step may take beside its decode rows (see the module's docstring)."""

    def __init__(self, target_ms: float, auto_factor: float, cost: Optional[StepCost] = None):
        self.target_ms = target_ms
        self.auto_factor = auto_factor
        self.cost = cost or StepCost()
        # Slow start: a paced chunk is at most twice the largest one whose step the model priced right
        # (a model fitted on whole prompts alone may price a chunk beside decode rows badly).
        self.trusted = PROBE_TOKENS
        # the largest chunk of a step without decode rows that the model priced right (its tokens'
        # price is then not far too low, and a chunk of up to that many may ride on the fixed price)
        self.priced_alone = 0

    @property
    def enabled(self) -> bool:
        return self.target_ms != 0

    def target_seconds(self, rows: int, kv: Optional[float] = None) -> float:
        if self.target_ms > 0:
            return self.target_ms / 1000.0
        return self.auto_factor * self.cost.decode_seconds(rows, kv)

    def prefill_cap(self, rows: int, start: int, kv: Optional[float] = None) -> Optional[int]:
        """The prompt-token cap of a step with `rows` decode rows reading `kv` positions (None: at
        the last step's context per row) whose first prompt chunk starts at position `start`; None:
        no cap (pacing off, or nothing decoding)."""
        cost = self.cost
        if not self.enabled or rows == 0 or cost.prompt_steps == 0:  # (no prompt step seen: no price yet)
            return None
        decode = cost.decode_seconds(rows, kv)
        fixed = cost.prices()[0]
        floor = max(1, cost.tokens_within(start, fixed + FLOOR_SHARE * (decode + fixed)))
        # the slow start's bound, but never below the chunk whose tokens cost what the step's fixed
        # part does (where that part dominates, a GPU's eager launches, any chunk is about the same
        # step), as far as prompts alone have shown the tokens' price right
        bound = max(self.trusted, min(self.priced_alone, cost.tokens_within(start, 2 * fixed)))
        return min(bound, max(floor, cost.tokens_within(start, self.target_seconds(rows, kv) - decode)))

    def observe(self, decode_rows: int, prompt_tokens: int, pairs: float, seconds: float,
                decode_kv: float = 0.0) -> None:
        x = step_features(decode_rows, prompt_tokens, pairs, decode_kv)
        if prompt_tokens:  # (a decode-only step asks no price: the model is not refitted for it)
            predicted = self.cost.predict(x)
            if decode_rows:  # a paced step: did the model price it right?
                right = seconds <= TRUST_SLACK * predicted
                self.trusted = max(self.trusted, 2 * prompt_tokens) if right else max(PROBE_TOKENS, prompt_tokens // 2)
            else:  # a prompt alone: is its tokens' price not far too low?
                near = seconds <= ALONE_SLACK * predicted
                self.priced_alone = max(self.priced_alone, prompt_tokens) if near else self.priced_alone // 2
        self.cost.observe(x, seconds)

    def observe_batch(self, batch: "SchedulerOutput", seconds: float) -> None:
        """A step the worker ran, and its wall time."""
        rows, tokens, pairs, kv = batch_shape(batch)
        self.observe(rows, tokens, pairs, seconds, kv)
