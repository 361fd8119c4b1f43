"""The KV tiers' test conversations (tests/test_kv_tiers.py, tests/test_kv_tiers_groups.py): a tiny
checkpoint, 6 conversations x 3 turns on one 37-token system prompt, each turn 9-23 tokens more,
so that every returning turn starts with its conversation's earlier blocks; transformers' greedy
tokens for every prompt; the turns run on an engine; the leak check after a workload."""
from __future__ import annotations

import random

from backend import SamplingParams
from hf_checkpoints import hf_greedy, make_checkpoint

MAX_TOKENS = 5


def chat_turns(arch: str, folder, seed: int, rng_seed: int):
    """(checkpoint path, turns[t][c] prompts, expected[t][c] greedy tokens)."""
    path = make_checkpoint(arch, folder, seed=seed)
    rng = random.Random(rng_seed)
    system = [rng.randrange(3, 512) for _ in range(37)]
    convs = [list(system) for _ in range(6)]
    turns = []
    for _ in range(3):
        for c in convs:
            c += [rng.randrange(3, 512) for _ in range(rng.randint(9, 23))]
        turns.append([list(c) for c in convs])
    flat = [p for turn in turns for p in turn]
    expected = hf_greedy(path, flat, [MAX_TOKENS] * len(flat))
    return path, turns, [expected[i * 6:(i + 1) * 6] for i in range(3)]


def run_turns(llm, turns):
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    outs = []
    for prompts in turns:
        outs.append([o.token_ids for o in llm.generate(prompts, params)])
        llm.check_integrity()
    return outs


def assert_idle(llm):
    """Nothing held or in flight: the device cache's blocks are all free, no host slot is pinned."""
    tiers = llm.engine.kv_tiers
    llm.check_integrity()
    assert llm.stats()["kv_blocks_used"] == 0
    assert tiers.idle and not tiers.busy and not any(tiers.host.pins)


def written_turns(llm_factory, turns):
    """Run the turns on an engine with a disk tier and close it (its cached blocks go to disk)."""
    llm = llm_factory()
    outs = run_turns(llm, turns)
    llm.close()
    return outs
