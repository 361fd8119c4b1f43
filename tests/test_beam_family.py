"""A beam search's beams are admitted as one family (issue 43's liveness bug): all of them start in
the step its first does, so no search holds part of its family's blocks while the rest waits
behind another request. On a 6-block cache that fits one search at a time: a more urgent request
arriving while a search's later beams would still wait, two searches and it all finish (equal to a
roomy cache's answers), the pool back to idle; a cancelled search whose later beams have not run yet
gives everything back. Every loop has a bounded step count."""
from __future__ import annotations

import pytest

from backend import LLM, SamplingParams
from hf_checkpoints import make_checkpoint

BLOCK = 16
SEARCH_A = [5, 17, 99, 200, 31, 7, 8, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55]  # 19 tokens
SEARCH_B = [(7 * i + 3) % 500 + 3 for i in range(17)]  # a block and one: its prompt cached, it runs at once
URGENT = [(11 * i + 5) % 500 + 3 for i in range(37)]
STEPS = 300  # every test's bound: far more than the work needs


def beams(width: int, n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, use_beam_search=True, best_of=width, n=n, max_tokens=12, ignore_eos=True)


# A: 2 blocks a beam, the prompt's first shared: 2 + 3 x 1 = 5 of 6. B: 2 + 1 x 1 = 3. The urgent
# request: 37 + 40 tokens, 5 blocks; beside A's first beam alone (2) it would not fit either.
REQUESTS = [("A", SEARCH_A, beams(4, 2)), ("B", SEARCH_B, beams(2, 2)),
            ("urgent", URGENT, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))]


@pytest.fixture(scope="module")
def llms(tmp_path_factory):
    path = str(make_checkpoint("llama", tmp_path_factory.mktemp("llama")))
    kw = dict(kv_block_size=BLOCK, max_num_batched_tokens=64, enable_chunked_context=True)
    roomy, tight = LLM(path, max_tokens_in_paged_kv_cache=1024, **kw), LLM(path, max_tokens_in_paged_kv_cache=6 * BLOCK, **kw)
    expected = {rid: [s.token_ids for s in o.samples or [o]]
                for (rid, _, _), o in zip(REQUESTS, roomy.generate([p for _, p, _ in REQUESTS], [s for _, _, s in REQUESTS]))}
    roomy.close()
    yield tight, expected
    tight.close()


def run_out(engine, finals: dict) -> None:
    for _ in range(STEPS):
        for o in engine.step():
            if o.finished:
                finals.setdefault(o.request_id, {})[o.index] = o.token_ids
        if not engine.has_work():
            return
    raise AssertionError(f"still working after {STEPS} steps: a request waits forever "
                         f"(running {[r.seq_id for r in engine.scheduler.running]}, "
                         f"waiting {[r.seq_id for r in engine.scheduler.waiting]})")


def idle(llm) -> None:
    stats = llm.stats()
    assert stats["kv_blocks_used"] == 0 and stats["kv_blocks_reserved"] == 0 and stats["num_beams_running"] == 0
    llm.check_integrity()


@pytest.mark.parametrize("urgent_priority", [-1, 0], ids=["more-urgent", "no-priorities"])
def test_a_search_starts_whole_and_an_urgent_request_never_hangs_it(llms, urgent_priority):
    llm, expected = llms
    engine, finals = llm.engine, {}
    engine.add_request("A", SEARCH_A, REQUESTS[0][2])
    engine.add_request("B", SEARCH_B, REQUESTS[1][2])
    engine.step()  # A's first beam computes the prompt; its three other beams start with it
    assert sorted(r.index for r in engine.scheduler.running if r.request_id == "A") == [0, 1, 2, 3]
    assert not [r for r in engine.scheduler.waiting if r.request_id == "A"], "a search's beams were left queued"
    engine.add_request("urgent", URGENT, REQUESTS[2][2], priority=urgent_priority)
    run_out(engine, finals)
    assert {rid: [got[i] for i in range(len(got))] for rid, got in finals.items()} == expected
    idle(llm)


def test_cancelling_a_search_whose_beams_have_not_run_frees_everything(llms):
    llm, _ = llms
    engine = llm.engine
    engine.add_request("A", SEARCH_A, REQUESTS[0][2])
    engine.add_request("B", SEARCH_B, REQUESTS[1][2])  # waits: A's family holds 5 of 6 blocks
    engine.step()
    assert engine.stats()["kv_blocks_reserved"] == 5, "A's family is not reserved whole"
    for rid, n in (("A", 2), ("B", 2)):  # A with beams that never ran a row; B wholly queued
        finals = engine.abort(rid)
        assert sorted(o.index for o in finals) == list(range(n)) and {o.finish_reason for o in finals} == {"abort"}
    run_out(engine, {})
    idle(llm)


def test_a_search_whose_prompt_is_cached_but_its_last_token_starts_whole(llms):
    """A prompt of a block and one token, cached: the first beam has its shared blocks at once,
    and its parked beams are not tried again in the pass that started them."""
    llm, expected = llms
    for _ in range(2):
        out = llm.generate([SEARCH_B], REQUESTS[1][2])[0]
        assert [s.token_ids for s in out.samples] == expected["B"]
    assert out.num_cached_tokens == BLOCK
    idle(llm)


def test_a_search_waits_for_slots_for_all_its_beams(llms, monkeypatch):
    """max_num_seqs 4 with one request running: a 4-beam search starts only once it has ended."""
    llm, expected = llms
    engine, finals = llm.engine, {}
    monkeypatch.setattr(engine.scheduler.config, "max_num_seqs", 4)
    engine.add_request("one", SEARCH_B[:5], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))  # 1 block
    engine.step()
    engine.add_request("A", SEARCH_A, REQUESTS[0][2])
    for _ in range(STEPS):
        for o in engine.step():
            if o.finished:
                finals.setdefault(o.request_id, {})[o.index] = o.token_ids
        assert len(engine.scheduler.running) <= 4
        if not engine.has_work():
            break
    assert [finals["A"][i] for i in range(2)] == expected["A"]
    idle(llm)


# (head, behind): 5 blocks each head; behind, 2 blocks that fit beside the running request now,
# outlast it, and do not fit in the 1 block spare at the head's reservation
BACKFILL = {"search-behind": (("head", URGENT, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)),
                              ("S", SEARCH_A[:3], SamplingParams(temperature=0.0, use_beam_search=True, best_of=2, n=2,
                                                                 max_tokens=13, ignore_eos=True))),
            "search-head": (("A", SEARCH_A, REQUESTS[0][2]),
                            ("P", SEARCH_B[:5], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)))}


@pytest.mark.parametrize("case", BACKFILL)
def test_backfill_counts_a_search_as_its_family(llms, monkeypatch, case):
    """Backfill on (max_num_seqs 8 under a 64-token budget). A 2-block request runs a few steps; the
    head (5 blocks; a search's: 2 + 3 x 1) waits for it; behind it, a request that fits now (2
    blocks) and would outlast it. A search behind (1 block a beam) would fit in what is spare at the
    head's reservation (1 block) were it one beam; a search as the head leaves 1 spare, not 4. Either
    way the one behind waits, and the head starts by its reserved step."""
    from backend.sched.backfill import Backfill
    llm, _ = llms
    engine, sched = llm.engine, llm.engine.scheduler
    monkeypatch.setattr(sched.config, "max_num_seqs", 8)
    monkeypatch.setattr(sched.admission, "backfill", Backfill(sched.blocks, 8, sched.policy))
    short = [(13 * i + 1) % 500 + 3 for i in range(30)]  # 2 blocks, no prefix shared with the others
    engine.add_request("short", short, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    engine.step()
    (head_id, head_prompt, head_params), behind = BACKFILL[case]
    head = engine.add_request(head_id, head_prompt, head_params)
    engine.add_request(*behind)
    engine.step()
    reserved = sched.reservation
    assert reserved is not None and reserved.seq_id == head_id
    assert not [r for r in sched.running if r.request_id == behind[0]], "started ahead of the head, delaying it"
    run_out(engine, {})
    assert head.first_scheduled_step <= reserved.step
    idle(llm)


def test_a_search_starts_whole_under_batching_mode_none(llms, monkeypatch):
    """batching_mode none admits one request while nothing runs: a search is one request (its later
    beams could never start after its first otherwise)."""
    from backend.sched.batching import NoBatchingGate
    llm, expected = llms
    monkeypatch.setattr(llm.engine.scheduler.admission, "gate", NoBatchingGate(llm.engine.scheduler.config))
    finals = {}
    llm.engine.add_request("A", SEARCH_A, REQUESTS[0][2])
    run_out(llm.engine, finals)
    assert [finals["A"][i] for i in range(2)] == expected["A"]
    idle(llm)


def test_sampled_completions_start_one_by_one_and_never_hang(llms):
    """n > 1 sampled completions share the first's prompt blocks but not a search's wait: the first
    runs on while a more urgent request that does not fit waits, and the others start after it."""
    llm, _ = llms
    engine, finals = llm.engine, {}
    engine.add_request("X", SEARCH_A, SamplingParams(temperature=0.0, n=3, max_tokens=12, ignore_eos=True))
    engine.step()
    assert [r.index for r in engine.scheduler.running] == [0], "sampled completions wait for the first's prompt"
    engine.add_request("urgent", URGENT, REQUESTS[2][2], priority=-1)
    run_out(engine, finals)
    assert len(set(map(tuple, finals["X"].values()))) == 1 and len(finals["X"]) == 3  # greedy: three equal
    idle(llm)
