"""Load or recompute (backend/sched/tier_choice.py, kv_tier_load_policy): the choice against
hand-computed cases, the policy key, the step model it shares with the pacer, and the prices the
engine measures at start. The engine-level tests (same tokens, tiers idle) are in test_kv_tiers.py,
beside the conversations they share."""
import os

import pytest

from backend import EngineConfig
from backend.kv.tiers.disk import DiskStore
from backend.kv.tiers.plan import CopyPrices, TierCounts
from backend.sched.step_cost import StepCost, step_features
from backend.sched.tier_choice import TierChoice

US = 1e-6
HOST, DISK = False, True


class Prices:
    """A step model with fixed prices: (fixed, per token, per attention pair / 1024)."""

    def __init__(self, per_token: float, per_pair: float = 0.0, prompt_steps: int = 1):
        self.per_token, self.per_pair, self.prompt_steps = per_token, per_pair, prompt_steps

    def prices(self):
        return 5.0, self.per_token, self.per_pair  # the fixed price is paid either way: never weighed

    def decode_seconds(self, rows: int) -> float:
        return 2.5e-3 * rows  # a step of `rows` decode rows


def choice(per_token=1000 * US, per_pair=0.0, plan=0.0, host=100 * US, disk=0.0, policy="auto", steps=1):
    return TierChoice(policy, 16, Prices(per_token, per_pair, steps), CopyPrices(plan, host, disk))


def test_a_cheap_copy_loads_the_whole_run():
    # 4 host blocks of a 100-token request: loading them costs 100 + 4 x 100 us and leaves 36 tokens
    # (36 ms) to compute, against 100 ms for all 100
    assert choice(plan=100 * US).blocks_to_load([HOST] * 4, 0, 100) == 4


def test_a_copy_dearer_than_the_tokens_it_saves_is_computed_again():
    # a block's copy (20 ms) against its 16 tokens (16 ms)
    assert choice(host=20_000 * US).blocks_to_load([HOST] * 4, 0, 100) == 0
    # one block found, where the copy costs just under / just over its tokens: a tie computes
    assert choice(host=15_999 * US).blocks_to_load([HOST], 0, 40) == 1
    assert choice(host=16_000 * US).blocks_to_load([HOST], 0, 40) == 0


def test_a_partial_prefix_loads_the_host_blocks_and_computes_the_dear_disk_ones():
    # host blocks at 0.1 ms, disk blocks at 0.1 + 50 ms against 16 ms of tokens each
    assert choice(disk=50_000 * US).blocks_to_load([HOST, HOST, DISK, DISK], 0, 100) == 2
    # a cheap disk loads them all; host blocks after a dear disk block are not reached
    assert choice(disk=1_000 * US).blocks_to_load([HOST, HOST, DISK, DISK], 0, 100) == 4
    assert choice(disk=50_000 * US).blocks_to_load([DISK, HOST, HOST], 0, 100) == 0
    # from a device prefix of 2 blocks: the first block found starts at token 32
    assert choice(disk=50_000 * US).blocks_to_load([HOST, DISK], 32, 100) == 1


def test_a_prefix_of_several_groups_loads_whole_when_its_copies_cost_less_than_its_tokens():
    # 6 copies (4 positions of the first group, a window of 2 in a local group) bring tokens 0..64 of 100
    assert choice(host=100 * US).worth_loading([HOST] * 6, 0, 64, 100)
    # each copy at 11 ms: 66 ms against the 64 ms of tokens they save; a tie computes
    assert not choice(host=11_000 * US).worth_loading([HOST] * 6, 0, 64, 100)
    assert not choice(host=64_000 * US / 6).worth_loading([HOST] * 6, 0, 64, 100)
    # a disk copy sits out a step of the 4 running rows (10 ms); the host one lands before the run
    assert choice(host=9_500 * US).worth_loading([HOST] * 6, 0, 64, 100, rows=4)
    assert not choice(host=9_500 * US).worth_loading([DISK] + [HOST] * 5, 0, 64, 100, rows=4)
    for policy, load in (("always", True), ("never", False)):
        assert choice(host=1.0, policy=policy).worth_loading([HOST] * 6, 0, 64, 100) is load
    assert choice(host=1.0, steps=0).worth_loading([HOST] * 6, 0, 64, 100)  # nothing priced yet: load
    c = choice(host=11_000 * US)
    assert c.choose_whole("r", [HOST] * 6, 0, 64, 100) is False and c.declined("r") == ([HOST] * 6, 0)


def test_the_attention_over_the_context_before_them_is_priced():
    # no per-token price, a pair per us: computing positions s..32 costs pairs(s, 33 - s) us:
    # from 0: 33 x 17 = 561, from 16: 17 x 25 = 425, from 32: 1 x 33 = 33. A block's copy costs
    # 200 us: one block (200 + 425 = 625) is worse than none (561), two (400 + 33 = 433) are better,
    # because the second block's tokens attend to the first's
    c = choice(per_token=0.0, per_pair=1024 * US, host=200 * US)
    assert c.compute_seconds(0, 33) == pytest.approx(561 * US)
    assert c.compute_seconds(16, 33) == pytest.approx(425 * US)
    assert c.blocks_to_load([HOST, HOST], 0, 33) == 2
    assert c.blocks_to_load([HOST], 0, 33) == 0


def test_a_load_that_sits_out_a_step_pays_for_it():
    # a block's tokens cost 16 ms; a disk block 1.1 ms to read and copy, and its request waits for the
    # read while the running requests take a step: 2.5 ms a decode row
    c = choice(disk=1000 * US)
    assert c.blocks_to_load([DISK], 0, 40, rows=0) == 1  # nothing runs: the read alone
    assert c.blocks_to_load([DISK], 0, 40, rows=4) == 1  # 1.1 + 10 < 16
    assert c.blocks_to_load([DISK], 0, 40, rows=8) == 0  # 1.1 + 20 > 16
    assert c.blocks_to_load([DISK, DISK], 0, 40, rows=8) == 2  # 2.2 + 20 < 32: the wait is paid once
    # host blocks land before the step's run on the CPU (at_once) but wait for a copy stream on a GPU
    assert c.blocks_to_load([HOST], 0, 40, rows=8) == 1
    assert c.blocks_to_load([HOST], 0, 40, rows=8, at_once=False) == 0
    assert c.blocks_to_load([HOST, DISK], 0, 40, rows=8) == 1  # the host block now, the disk one computed


def test_the_policies_and_an_engine_that_has_not_priced_a_prompt_yet():
    dear = dict(host=1.0)
    assert choice(policy="always", **dear).blocks_to_load([HOST, DISK, HOST], 0, 100) == 3
    assert choice(policy="never").blocks_to_load([HOST, DISK, HOST], 0, 100) == 0
    assert choice(steps=0, **dear).blocks_to_load([HOST, DISK], 0, 100) == 2  # no price yet: load
    assert choice().blocks_to_load([], 0, 100) == 0


def test_the_choice_is_counted_by_tier_when_its_request_starts():
    c, counts = choice(disk=50_000 * US), TierCounts(disk=True)
    assert c.choose("a", [HOST, HOST, DISK], 0, 100) == 2
    assert c.declined("b") == ([], 0)  # another request's choice: nothing
    where, k = c.declined("a")
    counts.lookup(8, 1, None, declined=where[k:])
    counts.chose(where, k)
    assert (counts.host["load_chosen"], counts.host["recompute_chosen"]) == (2, 0)
    assert (counts.disk["load_chosen"], counts.disk["recompute_chosen"]) == (0, 1)
    assert counts.disk["hits"] == 1 and counts.disk["misses"] == 7 - 1  # found, though computed again
    assert c.declined("a") == ([], 0)  # taken once


def test_the_step_model_is_the_one_the_pacer_learns():
    """The prices are the engine's own fit of its steps (pacing.StepCost): steps of 2 ms + 0.25 ms
    a prompt token; a 16-token block then costs 4 ms to compute again."""
    cost = StepCost()
    for rows, tokens in ((4, 0), (8, 0), (0, 64), (0, 128), (2, 32), (0, 16), (6, 0), (1, 200)):
        cost.observe(step_features(rows, tokens, 0.0), 2e-3 + 1e-4 * rows + 2.5e-4 * tokens)
    c = TierChoice("auto", 16, cost, CopyPrices(0.0, 3.9e-3, 0.0))
    assert c.compute_seconds(0, 16) == pytest.approx(4e-3, rel=1e-3)
    assert c.blocks_to_load([HOST] * 3, 0, 60) == 3
    c.prices = CopyPrices(0.0, 4.1e-3, 0.0)
    assert c.blocks_to_load([HOST] * 3, 0, 60) == 0


@pytest.mark.parametrize("value", ["sometimes", "", "AUTO"])
def test_the_policy_key_is_checked_once_naming_it(value):
    with pytest.raises(ValueError, match="kv_tier_load_policy must be one of auto, always, never"):
        EngineConfig(kv_tier_load_policy=value)
    assert EngineConfig().kv_tier_load_policy == "auto"
    assert EngineConfig.from_params({"kv_tier_load_policy": "never"}).kv_tier_load_policy == "never"


def test_a_disk_read_is_timed_on_a_file_it_deletes(tmp_path):
    store = DiskStore(str(tmp_path / "tier"), b"f" * 32, 64 << 10)
    try:
        seconds = store.time_read()
        assert 0 < seconds < 1.0
        assert not [n for n in os.listdir(store.folder) if n.endswith(".tmp") or n.endswith(".kv")]
        assert store.scan() == [] and store.unreadable == 0
    finally:
        store.close()


def test_the_copies_timed_at_start_leave_the_cache_as_it_was():
    import torch

    from backend.worker.device import DeviceEnv
    from backend.worker.kv_copier import KVCopier

    torch.manual_seed(3)
    caches = [(torch.randn(12, 16, 2, 8), torch.randn(12, 16, 2, 8)) for _ in range(2)]
    before = [(k.clone(), v.clone()) for k, v in caches]
    copier = KVCopier(DeviceEnv(torch.device("cpu"), torch.device("cpu")), caches, 16 * 4096)
    plan, per_block = copier.time_loads(8)
    assert plan >= 0 and per_block >= 0 and 0 < plan + per_block < 0.1
    assert all(torch.equal(a, b) for kv, was in zip(caches, before) for a, b in zip(kv, was))
    assert torch.equal(copier.slots[3, 1, 0], caches[1][0][3])  # blocks 0..7 went to slots 0..7 and back
