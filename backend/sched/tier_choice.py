"""Load or recompute: whether a prefix found in the KV tiers is copied back or computed again
(kv_tier_load_policy; issue 47). No torch here.

A request's prefix blocks after its device prefix that the host or disk tier holds may come back
(the copy's price, measured at the engine's start: `CopyPrices`, backend/engine/kv_tiers.py) or be
computed again with the rest of its prompt (the prompt tokens' price: the engine's own step-cost
model, `StepCost` of pacing.py, the one the prefill pacer and the drain estimate read). Loading the
first k of the m blocks found costs

    load(k) = plan + k x host block + (disk blocks among them) x disk block     (0 for k = 0)
    compute(k) = per token x (end - s_k) + per pair x pairs(s_k, end - s_k) / 1024

where s_k = start + k x block_size is where the prompt's computation then begins and `end` the
request's tokens: the tokens computed again and their attention over every position before them
(the context before them included). A load that cannot land before this step's model run (a disk
block: read on the disk thread; any load on a GPU: a copy stream the request waits for) also costs
the step the request sits out, priced as a step of the running requests' decode rows (0 when none
runs: the engine then waits for the load alone). Admission loads the k with the least load(k) + compute(k),
the whole run, none or a part (host blocks before dearer disk ones). Ties load less. Until the
model has priced a step with prompt tokens (the engine's first), every block found is loaded, as
`always` does; `never` loads none (the tiers still keep blocks: a baseline).
"""
from __future__ import annotations

from typing import Optional, Sequence

from backend.kv.tiers.plan import CopyPrices
from backend.sched.step_cost import PAIR_UNIT, StepCost, chunk_pairs


class TierChoice:
    """How many of the prefix blocks found in the tiers a request loads (the module's docstring)."""

    def __init__(self, policy: str, block_size: int, cost: StepCost, prices: Optional[CopyPrices] = None):
        self.policy = policy
        self.block_size = block_size
        self.cost = cost  # shared with the pacer: one model of this engine's steps
        self.prices = prices or CopyPrices()
        self.last: Optional[tuple[str, list[bool], int]] = None  # (seq_id, where, loaded): counted when it starts

    def compute_seconds(self, start: int, end: int, prices: Optional[tuple[float, float, float]] = None) -> float:
        """The price of computing positions start..end-1 of a prompt (beyond a step's fixed price);
        `prices`: the step model's (StepCost.prices), read once by the caller."""
        _, per_token, per_pair = prices or self.cost.prices()
        n = max(0, end - start)
        return per_token * n + per_pair * chunk_pairs(start, n) / PAIR_UNIT

    def blocks_to_load(self, from_disk: Sequence[bool], start: int, end: int, rows: int = 0,
                       at_once: bool = True) -> int:
        """Of the blocks found after the device prefix (True: on disk, False: in host memory), how
        many from the first to load; `start`: the tokens already there, `end`: the request's tokens;
        `rows`: the requests running (the step a waiting load sits out); `at_once`: host blocks land
        before this step's model run (the CPU)."""
        m = len(from_disk)
        if self.policy == "never":
            return 0
        if self.policy == "always" or m == 0 or not self.cost.prompt_steps:
            return m
        prices, wait = self.cost.prices(), self.cost.decode_seconds(rows) if rows else 0.0
        best, best_k, disk = self.compute_seconds(start, end, prices), 0, 0
        for k in range(1, m + 1):
            disk += from_disk[k - 1]
            seconds = (self.prices.load_seconds(k - disk, disk)
                       + self.compute_seconds(start + k * self.block_size, end, prices))
            seconds += wait if disk or not at_once else 0.0
            if seconds < best:
                best, best_k = seconds, k
        return best_k

    def worth_loading(self, from_disk: Sequence[bool], start: int, hit_end: int, end: int, rows: int = 0,
                      at_once: bool = True) -> bool:
        """A prefix that is loaded whole or not at all (a model of several KV-cache groups:
        backend/kv/tiers/grouped.py): these blocks bring the request from `start` to `hit_end`
        tokens; is that cheaper than computing them?"""
        if self.policy == "never":
            return False
        if self.policy == "always" or not from_disk or not self.cost.prompt_steps:
            return True
        prices, disk = self.cost.prices(), sum(from_disk)
        seconds = self.prices.load_seconds(len(from_disk) - disk, disk) + self.compute_seconds(hit_end, end, prices)
        seconds += self.cost.decode_seconds(rows) if rows and (disk or not at_once) else 0.0
        return seconds < self.compute_seconds(start, end, prices)

    def choose_whole(self, seq_id: str, from_disk: list[bool], start: int, hit_end: int, end: int, rows: int = 0,
                     at_once: bool = True) -> bool:
        """worth_loading, kept until the request starts (`declined`)."""
        load = self.worth_loading(from_disk, start, hit_end, end, rows, at_once)
        self.last = (seq_id, from_disk, len(from_disk) if load else 0)
        return load

    def choose(self, seq_id: str, from_disk: list[bool], start: int, end: int, rows: int = 0,
               at_once: bool = True) -> int:
        """blocks_to_load, kept until the request starts (`declined`)."""
        k = self.blocks_to_load(from_disk, start, end, rows, at_once)
        self.last = (seq_id, from_disk, k)
        return k

    def declined(self, seq_id: str) -> tuple[list[bool], int]:
        """The blocks found for seq_id at its last choice and how many it loads ([], 0: none chosen)."""
        if self.last is None or self.last[0] != seq_id:
            return [], 0
        _, where, k = self.last
        self.last = None
        return where, k
