"""Block manager: unit cases and a hypothesis state machine of grows and frees."""
from __future__ import annotations

import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from backend.kv.block_manager import BlockManager
from backend.core.errors import NoFreeBlocksError


def test_grow_maps_tokens_to_slots_and_free_returns_blocks():
    bm = BlockManager(num_blocks=8, block_size=4)
    bm.grow("a", 5)  # 5 tokens -> 2 blocks
    assert bm.num_blocks_of("a") == 2 and bm.num_free_blocks == 6
    table = bm.block_table("a")
    assert bm.slot("a", 0) == table[0] * 4 and bm.slot("a", 4) == table[1] * 4
    bm.grow("a", 8)  # still 2 blocks
    assert bm.num_blocks_of("a") == 2
    bm.grow("a", 9)
    assert bm.num_blocks_of("a") == 3
    bm.free("a")
    assert bm.num_used_blocks == 0
    bm.check_integrity()


def test_grow_beyond_capacity_raises_and_changes_nothing():
    bm = BlockManager(num_blocks=3, block_size=2)
    bm.grow("a", 4)
    with pytest.raises(NoFreeBlocksError):
        bm.grow("b", 3)
    assert bm.num_blocks_of("b") == 0 and bm.num_free_blocks == 1
    bm.check_integrity()


def test_check_integrity_catches_a_leak():
    bm = BlockManager(num_blocks=4, block_size=2)
    bm.grow("a", 2)
    bm._tables.pop("a")  # drop the owner without freeing
    with pytest.raises(AssertionError):
        bm.check_integrity()


class BlockMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.bm = BlockManager(num_blocks=16, block_size=3)
        self.tokens: dict[str, int] = {}

    @rule(seq=st.sampled_from("abcdef"), extra=st.integers(0, 20))
    def grow(self, seq, extra):
        want = self.tokens.get(seq, 0) + extra
        if self.bm.can_grow(seq, want):
            self.bm.grow(seq, want)
            self.tokens[seq] = want
        else:
            with pytest.raises(NoFreeBlocksError):
                self.bm.grow(seq, want)

    @rule(seq=st.sampled_from("abcdef"))
    def free(self, seq):
        self.bm.free(seq)
        self.tokens.pop(seq, None)

    @invariant()
    def consistent(self):
        self.bm.check_integrity()
        owned = [b for s in self.tokens for b in self.bm.block_table(s)]
        assert len(owned) == len(set(owned)), "a block is owned twice"
        assert len(owned) + self.bm.num_free_blocks == self.bm.num_blocks, "a block leaked"
        for s, n in self.tokens.items():
            assert self.bm.num_blocks_of(s) == self.bm.blocks_for(n)


TestBlockMachine = BlockMachine.TestCase
TestBlockMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


class PrefixCacheMachine(RuleBasedStateMachine):
    """Sequences over a tiny alphabet share prefixes. A fake cache records which tokens each block
    holds; every block reused for a prefix must hold exactly that prefix's tokens."""

    def __init__(self):
        super().__init__()
        self.bm = BlockManager(num_blocks=12, block_size=2, enable_prefix_caching=True)
        self.contents: dict[int, tuple] = {}
        self.active: dict[str, list[int]] = {}

    @rule(seq=st.sampled_from("abcde"), tokens=st.lists(st.sampled_from([1, 2]), min_size=1, max_size=9))
    def start(self, seq, tokens):
        if seq in self.active:
            return
        reused = self.bm.reuse_prefix(seq, tokens)
        assert reused % 2 == 0 and reused < len(tokens)
        table = self.bm.block_table(seq)
        for i, block in enumerate(table):
            assert self.contents[block] == tuple(tokens[2 * i:2 * i + 2]), "reused a block with other tokens"
        if not self.bm.can_grow(seq, len(tokens)):
            self.bm.free(seq)
            return
        self.bm.grow(seq, len(tokens))
        table = self.bm.block_table(seq)
        for i in range(reused // 2, len(table)):  # "compute" the rest: write the fake cache
            self.contents[table[i]] = tuple(tokens[2 * i:2 * i + 2])
        self.bm.register_computed(seq, tokens, len(tokens))
        self.active[seq] = tokens

    @rule(seq=st.sampled_from("abcde"))
    def finish(self, seq):
        self.bm.free(seq)
        self.active.pop(seq, None)

    @invariant()
    def consistent(self):
        self.bm.check_integrity()
        assert sum(self.bm.num_blocks_of(s) for s in self.active) >= self.bm.num_used_blocks


TestPrefixCacheMachine = PrefixCacheMachine.TestCase
TestPrefixCacheMachine.settings = settings(max_examples=80, stateful_step_count=40, deadline=None)


def test_prefix_keys_are_sha256_chained_over_parent_and_tokens():
    import hashlib
    from array import array

    from backend.kv.block_manager import block_hashes
    tokens = list(range(40, 52))
    keys = block_hashes(tokens, 4)
    want, parent = [], b""
    for i in range(0, 12, 4):
        parent = hashlib.sha256(parent + array("q", tokens[i:i + 4]).tobytes()).digest()
        want.append(parent)
    assert keys == want
    # a block's key depends on everything before it, not only on its own tokens
    assert block_hashes([9, 9, 9, 9] + tokens[4:8], 4)[1] != keys[1]
