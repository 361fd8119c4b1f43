"""Admission's side of the KV tiers: a prefix in host memory or on disk comes back instead of being
computed again (docs/design.md, "KV-cache tiers"). No torch here.

`TierAdmission` is the admission's collaborator (admission.py) when the tiers are on: it finds how
far past a waiting request's device prefix the tiers hold it, asks `TierChoice` (tier_choice.py)
whether loading is cheaper than computing, claims the blocks, starts the load and counts where
each block was found. A model of one KV-cache group loads a run of blocks after its device prefix;
a model of several (Gemma 3's sliding-window layers) loads a whole `TieredHit`
(backend/kv/tiers/grouped.py): the first group's blocks and each local group's window, sharing the
blocks still cached on the device.
"""
from __future__ import annotations

from typing import Callable, Optional

from backend.core.request import Request
from backend.kv.tiers.grouped import TieredHit, tiered_hit
from backend.kv.tiers.plan import TierClaim
from backend.sched.pool import RequestPool
from backend.sched.step_cost import StepCost
from backend.sched.tier_choice import TierChoice


class TierAdmission:
    def __init__(self, load_policy: str, pool: RequestPool, tiers, cost: Optional[StepCost],
                 hashes: Callable[[Request], list[bytes]]):
        """`tiers`: the KV tiers (backend/kv/tiers/manager.KVTiers); `hashes(req)`: req's prefix keys."""
        self.tiers = tiers
        self.pool = pool
        self.blocks = pool.blocks
        self.hashes = hashes
        # Load or recompute a prefix found there (tier_choice.py), priced by `cost`: the scheduler's step model.
        self.choice = TierChoice(load_policy, self.blocks.block_size, cost or StepCost(), tiers.prices)
        self.grouped = len(getattr(self.blocks, "groups", ())) > 1
        self._hits: dict[str, tuple[TieredHit, bool]] = {}  # a grouped hit found, and whether it loads, until it starts

    def begin(self) -> None:
        """An admission pass begins: hits found in an earlier one are stale."""
        self._hits.clear()

    def lower_blocks(self, req: Request) -> int:
        """How many blocks after req's device prefix come back from a lower tier (nothing is claimed
        yet). Where copies are done when issued (the CPU) and all of them are in host memory, they
        come back before this step's model run: they count as computed at once, and 0 is returned."""
        if req.index or req.computes_whole_prompt:
            return 0
        bs, start, at_once = self.blocks.block_size, req.num_computed_tokens, self.tiers.loads_at_once
        rows = len(self.pool.running)
        if self.grouped:
            self._hits.pop(req.seq_id, None)
            hit = tiered_hit(self.blocks, req.seq_id, self.hashes(req), start // bs, self.tiers.where)
            if hit is None:
                return 0
            chosen = self.choice.choose_whole(req.seq_id, hit.from_disk, start, hit.end * bs, req.num_tokens,
                                              rows, at_once)
            self._hits[req.seq_id] = (hit, chosen)
            lower, on_disk = (hit.end - hit.start if chosen else 0), any(hit.from_disk)
        else:
            where = self.tiers.locate(self.hashes(req)[start // bs:])
            lower = self.choice.choose(req.seq_id, where, start, req.num_tokens, rows, at_once)
            on_disk = any(where[:lower])
        if lower and not on_disk and at_once:
            req.num_computed_tokens += lower * bs  # undone with the rest if it does not fit
            return 0
        return lower

    def start(self, req: Request, lower: int, n: int, now: float, step: int) -> None:
        """Start req: with `lower` blocks to come back, holding its device prefix and the blocks
        they return to (a claim may get fewer: no host slot left to stage a disk block in; with
        none it runs from its next step on); else as usual with its first n tokens' blocks, those
        that come back at once included. Counts where its prefix was found."""
        hit = self._hits.pop(req.seq_id, None)
        if hit is not None:
            return self._start_grouped(req, *hit, lower, n, now, step)
        bs, hashes = self.blocks.block_size, self.hashes(req)
        first = len(self.blocks.block_table(req.seq_id))  # its device prefix
        at_once = (req.num_computed_tokens - first * bs) // bs  # host blocks copied before this step's run
        claim = self.tiers.claim(hashes[first:first + (lower or at_once)]) if lower or at_once else None
        got = claim.num_blocks if claim is not None else 0
        assert lower or got == at_once, "host blocks probed for this step are gone"
        self.pool.start(req, (first + got) * bs if lower else req.num_computed_tokens + n, now, step)
        where, chosen = self.choice.declined(req.seq_id)
        self.tiers.counts.lookup(len(hashes), first, claim, declined=where[chosen:])
        claimed = list(claim.from_disk) if claim is not None else []  # (where a staging slot took a host block's)
        self.tiers.counts.chose(claimed + where[chosen:], got)  # (chosen but not claimed: misses)
        if claim is not None:  # it runs once the load is done (`landed`), or now for blocks back at once
            blocks = self.blocks.block_table(req.seq_id)[first:first + got]
            req.kv_load = self.tiers.start_load(req.seq_id, claim, blocks)
            req.kv_load.counted = not lower

    def _start_grouped(self, req: Request, hit: TieredHit, chosen: bool, lower: int, n: int, now: float,
                       step: int) -> None:
        """start() for a model of several groups: when the hit is `chosen`, its device blocks
        shared, blocks taken for its loads, each claimed (`_claim_whole`: a shorter hit where too few
        host slots are left to stage its disk blocks in; with none, the request starts from its
        device prefix and runs from its next step on)."""
        bs = self.blocks.block_size
        loaded, claim = self._claim_whole(req, hit) if chosen else (hit, None)
        assert claim is not None or lower or not chosen, "host blocks probed for this step are gone"
        if claim is not None:
            taken = self.blocks.attach(req.seq_id, loaded.entries)
            blocks = [taken[g].pop(0) for g in _load_groups(loaded)]
        tokens = loaded.end * bs if claim is not None and lower else req.num_computed_tokens + (0 if lower else n)
        self.pool.start(req, tokens, now, step)
        found = hit.first_group  # per position: None on the device, False in host memory, True on disk
        self.tiers.counts.found(len(self.hashes(req)), hit.start + found.count(None), found.count(False),
                                found.count(True))
        self.choice.declined(req.seq_id)  # (its record of the choice: the hit's, counted here)
        kept = loaded.from_disk if claim is not None else []  # loaded, then the hit's others computed again
        held = set(loaded.keys) if claim is not None else set()
        self.tiers.counts.chose(kept + [d for k, d in zip(hit.keys, hit.from_disk) if k not in held], len(kept))
        if claim is not None:
            req.kv_load = self.tiers.start_load(req.seq_id, claim, blocks)
            req.kv_load.positions = loaded.end - loaded.start
            req.kv_load.counted = not lower

    def _claim_whole(self, req: Request, hit: TieredHit) -> tuple[TieredHit, Optional[TierClaim]]:
        """Claim every load of `hit`, or of the longest shorter hit whose loads fit the host slots
        a claim could take (a disk block is staged in a host slot, and a host front may hold fewer
        than a long history's blocks): a part of a hit would leave a local group without its window,
        a shorter hit brings its own. (hit, None) when not even one block's hit fits."""
        hashes = self.hashes(req)
        while True:
            claim = self.tiers.claim(hit.keys)
            if claim is not None and claim.num_blocks == len(hit.keys):
                return hit, claim
            room = claim.num_blocks if claim is not None else 0
            if claim is not None:
                self.tiers.drop_claim(claim)
            shorter = None
            for end in range(hit.end - 1, hit.start, -1):
                shorter = tiered_hit(self.blocks, req.seq_id, hashes, hit.start, self.tiers.where, end)
                if shorter is None or len(shorter.keys) <= room:
                    break
            if shorter is None or len(shorter.keys) > room:
                return hit, None
            hit = shorter

    def arrived(self, req: Request) -> Optional[int]:
        """req's load is done: the tokens it brought (0: counted when it started); None when a
        grouped load failed (a disk file's checks): the request computes from its device prefix."""
        load = req.kv_load
        req.kv_load = None
        if load.positions is not None and not load.num_loaded:
            return None
        if load.counted:
            return 0
        return (load.positions if load.positions is not None else load.num_loaded) * self.blocks.block_size


def _load_groups(hit: TieredHit) -> list[int]:
    """The group of each of the hit's loads, in their order (position, then group)."""
    groups = []
    for i in range(hit.end - hit.start):
        groups += [g for g, entries in enumerate(hit.entries) if entries[i] is None]
    return groups
