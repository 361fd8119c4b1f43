"""The queue's expected drain time: how long until each waiting request starts, and how long a
request arriving now would wait for its first token (issue 45, "overload told early"). No torch.

`DrainEstimator.update` runs after each engine step, on the engine thread: it replays the work the
engine knows of as a fluid simulation, and publishes a `Snapshot` (immutable, swapped in one
assignment) that any thread reads at arrival in O(max_num_seqs), without a lock. It replays when
the running or waiting requests' counts changed since the last replay, or `REFRESH_SECONDS` after
it; between, the batch only decodes and the last snapshot stands (an estimate at most that much
older, so a little higher: the decode steps since are not taken off). Replaying after every step
cost a batch-1 decode step of SmolLM2 ~0.03 ms of the host's ~0.3 (docs/performance.md, "Issue 47 on
the Zen 4 EPYC, continued"). What it replays:

- running requests: their prompt tokens still to compute and their tokens still to generate (up
  to max_tokens: the estimate is the worst case of an EOS that never comes), and the KV blocks
  they hold or have reserved;
- waiting requests, in the order they start (priority, arrival): each starts once a slot
  (`max_num_seqs`) and its KV blocks (under `guaranteed_no_evict`, prompt + max_tokens; under
  `max_utilization`, its prompt) are free, i.e. once enough running requests have finished; its
  prompt then takes ceil(prompt / chunk) steps beside the decode rows, a chunk being the step's
  token budget (`max_num_batched_tokens` less the decode rows) or the prefill pacer's cap;
- the price of a step: the pacer's online model (`Pacer.cost`: decode rows, prompt tokens,
  attention pairs) once it has seen both kinds of step, else `EwmaCost`, a moving average of the
  measured decode-step time and prompt-token time. Before any step has run nothing is known and
  every wait is 0 (no request is refused on a guess).

Prefix-cache hits, speculative drafts and early EOS make the real wait shorter: the figure is an
upper estimate, tested against a synthetic workload with fixed step times (tests/test_drain.py).
Only the first `MAX_SIMULATED` waiting requests are replayed; the rest are extrapolated at their
mean spacing, so a step costs O(max_num_seqs + MAX_SIMULATED) whatever the queue holds: measured
on this project's 2-core EPYC, 0.2 ms a step with 64 running and none waiting, ~1 ms with 256 or
1,024 waiting; the arrival check reads the snapshot in ~4 us (tests/test_drain.py's workload).
"""
from __future__ import annotations

import heapq
import itertools
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from backend.sched.pacing import Pacer

MAX_SIMULATED = 128  # waiting requests replayed one by one each step; the rest extrapolated
EWMA_ALPHA = 0.2     # weight of the newest step in EwmaCost
CAP_BUCKETS = 16     # the pacer's cap is asked for at most this many row counts a step
REFRESH_SECONDS = 0.05  # while the running and waiting counts stand, the snapshot is replayed at most this often


class EwmaCost:
    """The fallback price of a step: moving averages of a decode-only step's seconds (whatever its
    rows) and of a prompt token's seconds (a step with prompt tokens / its prompt tokens)."""

    def __init__(self) -> None:
        self.decode_step: Optional[float] = None
        self.token: Optional[float] = None

    def observe(self, decode_rows: int, prompt_tokens: int, seconds: float) -> None:
        if not math.isfinite(seconds) or seconds <= 0:
            return
        if prompt_tokens:
            self.token = _ewma(self.token, seconds / prompt_tokens)
        elif decode_rows:
            self.decode_step = _ewma(self.decode_step, seconds)

    @property
    def known(self) -> bool:
        return self.decode_step is not None or self.token is not None

    def decode_seconds(self, rows: int) -> float:
        return (self.decode_step or 0.0) if rows else 0.0

    def prompt_seconds(self, start: int, n: int) -> float:
        return (self.token or 0.0) * n


def _ewma(old: Optional[float], new: float) -> float:
    return new if old is None else old + EWMA_ALPHA * (new - old)


class Prices:
    """A cost model's prices frozen at one step, readable from any thread: the decode rows' step
    time per row count, and a prompt's price as fixed per step + q(end) - q(start), q quadratic
    (per-token and attention-pair terms: exact for pacing.StepCost, linear for EwmaCost)."""

    def __init__(self, cost, max_rows: int, cap: Optional[Callable[[int], Optional[int]]] = None):
        one, most = cost.decode_seconds(1), cost.decode_seconds(max(1, max_rows))
        if one > 0 and most > 0:  # linear in the rows from 1 on (both models): two reads, not one per row count
            slope = (most - one) / max(1, max_rows - 1)
            self.decode = [cost.decode_seconds(0)] + [one + slope * (r - 1) for r in range(1, max_rows + 1)]
        else:
            self.decode = [cost.decode_seconds(r) for r in range(max_rows + 1)]
        self.fixed = cost.prompt_seconds(0, 0)
        one, two = cost.prompt_seconds(0, 1) - self.fixed, cost.prompt_seconds(0, 2) - self.fixed
        self.a = (two - 2 * one) / 2
        self.b = one - self.a
        self._cap = cap
        self._caps: dict[int, Optional[int]] = {}
        self._bucket = max(1, max_rows // CAP_BUCKETS)

    def decode_seconds(self, rows: int) -> float:
        return self.decode[min(rows, len(self.decode) - 1)]

    def cap(self, rows: int) -> Optional[int]:
        """The pacer's prompt-token cap beside `rows` decode rows (None: not paced), asked of the
        pacer for at most CAP_BUCKETS row counts a step (rows rounded to a bucket's)."""
        if self._cap is None or rows == 0:
            return None
        rows = max(1, round(rows / self._bucket) * self._bucket)
        if rows not in self._caps:
            self._caps[rows] = self._cap(rows)
        return self._caps[rows]

    def prefill(self, start: int, n: int, rows: int, budget: int) -> tuple[float, int]:
        """(seconds, steps) of computing n prompt tokens from position start beside `rows` decode
        rows, in chunks of the step's budget or the pacer's cap."""
        if n <= 0:
            return 0.0, 0
        chunk = max(1, budget - rows)
        cap = self.cap(rows)
        if cap is not None:
            chunk = max(1, min(chunk, cap))
        steps = -(-n // chunk)
        q = lambda x: self.a * x * x + self.b * x  # noqa: E731
        return steps * (self.decode_seconds(rows) + self.fixed) + q(start + n) - q(start), steps


@dataclass(frozen=True)
class Limits:
    max_num_seqs: int
    max_num_batched_tokens: int
    num_blocks: int


@dataclass(frozen=True)
class Work:
    """One sequence's work: prompt tokens still to compute (from `start`), tokens still to
    generate, and the KV blocks it holds or reserves (a waiting one: needs to start)."""
    prompt: int
    decode: int
    blocks: int
    start: int = 0
    key: str = ""


@dataclass(frozen=True)
class Snapshot:
    """The state after the queue has drained, as of one step; `waits`: seconds from that step
    until each simulated waiting sequence starts (by key)."""
    at: float = 0.0
    drain_seconds: float = 0.0  # until the last waiting sequence starts
    t_end: float = 0.0
    d_end: int = 0  # decode steps run by then
    finishes: tuple = ()  # (decode step it ends at, its blocks), ascending: the sequences running then
    blocks_used: int = 0
    waits: dict = field(default_factory=dict)
    spacing: float = 0.0  # mean seconds between starts: the estimate for waiting sequences past the replayed
    replayed: int = 0
    prices: Optional[Prices] = None
    limits: Optional[Limits] = None


def simulate(running: Sequence[Work], waiting: Sequence[Work], limits: Limits, prices: Prices,
             now: float = 0.0, beyond: int = 0) -> Snapshot:
    """Replay the running and waiting sequences (see the module docstring); `beyond`: waiting
    sequences after these, not replayed but counted at the replayed ones' mean spacing."""
    heap = [(w.decode, w.blocks) for w in running]  # (decode step it ends at, blocks)
    heapq.heapify(heap)
    used = sum(w.blocks for w in running)
    rows = sum(1 for w in running if w.prompt == 0)
    t, d = 0.0, 0
    for w in running:  # their unfinished prompts, beside the rows already decoding
        seconds, steps = prices.prefill(w.start, w.prompt, rows, limits.max_num_batched_tokens)
        t, d = t + seconds, d + steps
    waits: dict[str, float] = {}
    for w in waiting:
        t, d, used = _free_room(heap, t, d, used, w.blocks, limits, prices)
        waits[w.key] = t
        seconds, steps = prices.prefill(w.start, w.prompt, len(heap), limits.max_num_batched_tokens)
        t, d = t + seconds, d + steps
        heapq.heappush(heap, (d + w.decode, w.blocks))
        used += w.blocks
    drain = max(waits.values(), default=0.0)
    spacing = drain / len(waiting) if waiting else 0.0
    return Snapshot(now, drain + beyond * spacing, t + beyond * spacing, d, tuple(sorted(heap)), used, waits,
                    spacing, len(waiting), prices, limits)


def _free_room(heap: list, t: float, d: int, used: int, need: int, limits: Limits, prices: Prices):
    """Run decode steps until a sequence needing `need` blocks fits: (time, decode step, blocks used)."""
    while heap and (len(heap) >= limits.max_num_seqs or used + need > limits.num_blocks):
        end, blocks = heapq.heappop(heap)
        if end > d:
            t += (end - d) * prices.decode_seconds(len(heap) + 1)
            d = end
        used -= blocks
    return t, d, used


def expected_ttft(snapshot: Snapshot, prompt: int, blocks: int) -> float:
    """Seconds until a sequence arriving after the snapshot's step (prompt tokens, KV blocks it
    needs to start) would get its first token: the queue drains, room frees, its prompt runs. 0
    before anything is known. As of that step: the time since is not taken off (it is under a step
    while the engine runs, and a step that hangs must not make the queue look empty)."""
    s = snapshot
    if s.prices is None:
        return 0.0
    heap = list(s.finishes)  # sorted: a valid heap
    t, d, used = _free_room(heap, s.t_end, s.d_end, s.blocks_used, blocks, s.limits, s.prices)
    seconds, _ = s.prices.prefill(0, prompt, len(heap), s.limits.max_num_batched_tokens)
    return t + seconds


class DrainEstimator:
    """The engine's drain estimate (see the module docstring): `observe` each step's time, `update`
    after each step (engine thread); `expected_ttft`, `drain_seconds`, `wait_of` from any thread."""

    def __init__(self, limits: Limits, no_evict: bool, blocks_for: Callable[[int], int]):
        self.limits = limits
        self.no_evict = no_evict
        self.blocks_for = blocks_for
        self.ewma = EwmaCost()
        self.snapshot = Snapshot()
        self._replayed: tuple[float, int, int] = (-math.inf, -1, -1)  # (when, running, waiting) of the last replay

    def observe(self, decode_rows: int, prompt_tokens: int, seconds: float) -> None:
        self.ewma.observe(decode_rows, prompt_tokens, seconds)

    def need(self, prompt: int, max_tokens: int) -> int:
        """KV blocks a waiting sequence needs to start."""
        return self.blocks_for(prompt + max_tokens - 1 if self.no_evict else prompt)

    def update(self, scheduler, now: Optional[float] = None) -> None:
        now = time.monotonic() if now is None else now
        counts = (len(scheduler.running), len(scheduler.waiting))
        if counts == self._replayed[1:] and now - self._replayed[0] < REFRESH_SECONDS:
            return  # the same requests decoding: the last snapshot stands (see the module's docstring)
        pacer: Optional[Pacer] = getattr(scheduler, "pacer", None)
        model = pacer.cost if pacer is not None and pacer.cost.prompt_steps and \
            pacer.cost.steps > pacer.cost.prompt_steps else None
        if model is None and not self.ewma.known:
            return
        cap = (lambda rows: pacer.prefill_cap(rows, 0)) if model is not None and pacer.enabled else None
        prices = Prices(model or self.ewma, self.limits.max_num_seqs, cap)
        policy = scheduler.policy
        running = [Work(max(0, r.num_prompt_tokens - r.num_computed_tokens), r.params.max_tokens - len(r.output_token_ids),
                        policy.reserved_for(r), min(r.num_computed_tokens, r.num_prompt_tokens), r.seq_id)
                   for r in scheduler.running]
        queue = scheduler.waiting
        waiting = [Work(r.num_prompt_tokens, r.params.max_tokens - len(r.output_token_ids),
                        self.need(r.num_prompt_tokens, r.params.max_tokens), 0, r.seq_id)
                   for r in itertools.islice(queue, MAX_SIMULATED)]
        self.snapshot = simulate(running, waiting, self.limits, prices, now, beyond=max(0, len(queue) - len(waiting)))
        self._replayed = (now, *counts)

    def drain_seconds(self) -> float:
        """Seconds until every request waiting at the last step has started (from that step)."""
        return self.snapshot.drain_seconds

    def expected_ttft(self, prompt: int, max_tokens: int) -> float:
        return expected_ttft(self.snapshot, prompt, self.need(prompt, max_tokens))

    def wait_of(self, seq_id: str, position: int) -> Optional[float]:
        """Seconds from the last step until the waiting sequence at this place starts (None: unknown)."""
        s = self.snapshot
        if s.prices is None:
            return None
        wait = s.waits.get(seq_id)
        if wait is None and position >= s.replayed:
            wait = max(s.waits.values(), default=0.0) + (position - s.replayed + 1) * s.spacing
        return wait
