"""The step contract (backend/core/step.py) as the engine uses it: no live Request crosses into the
worker (plans and the worker's persistent batch hold none; a plan pickles as it is, as tensor
parallelism sends it), a sequence is described in full once and then only by deltas, and the
worker's batch follows the scheduler's requests exactly (their tokens, what they hold)."""
import dataclasses
import pickle

import pytest

from backend import LLM, SamplingParams
from backend.core.request import Request
from backend.core.step import StepPlan

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}


def requests_in(value, seen=None) -> list:
    """Every Request reachable from `value` through dataclass fields, slots, containers and dicts."""
    seen = set() if seen is None else seen
    if id(value) in seen or isinstance(value, (str, bytes, int, float, bool, type(None))):
        return []
    seen.add(id(value))
    if isinstance(value, Request):
        return [value]
    if dataclasses.is_dataclass(value):
        children = [getattr(value, f.name) for f in dataclasses.fields(value)]
    elif isinstance(value, dict):
        children = list(value.keys()) + list(value.values())
    elif isinstance(value, (list, tuple, set)):
        children = list(value)
    elif hasattr(value, "__slots__"):
        children = [getattr(value, name, None) for name in value.__slots__]
    else:
        children = list(vars(value).values()) if hasattr(value, "__dict__") and type(value).__module__.startswith(
            "backend") else []
    return [r for child in children for r in requests_in(child, seen)]


def test_the_checker_finds_a_request_wherever_it_hides():
    req = Request("r", [1, 2], SamplingParams())
    assert requests_in(StepPlan(finished_ids=["a"])) == []
    assert requests_in([{"x": (StepPlan(kv_copies=req),)}]) == [req]


@pytest.fixture(scope="module")
def recorded(default_model_dir):
    """A workload of every kind of row: n > 1 (forked prompts), n-gram verify rows, a JSON schema
    (grammar masks), penalties, finished and aborted sequences; every plan the worker ran."""
    llm = LLM(str(default_model_dir), max_num_seqs=6, speculative_config=NGRAM, kv_block_size=16)
    runner = llm.engine.runner
    plans, held = [], []
    execute = runner.execute

    def recording(plan):
        plans.append(plan)
        result = execute(plan)
        held.append({sid: list(s.all_token_ids) for sid, s in runner.batch.seqs.items()})
        return result

    runner.execute = recording
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6] * 3, "once upon a time", "a list:", [9] * 20]
    params = [SamplingParams(max_tokens=14, temperature=0, ignore_eos=True, n=2),
              SamplingParams(max_tokens=10, temperature=0.9, seed=3, repetition_penalty=1.3, ignore_eos=True),
              SamplingParams(max_tokens=30, temperature=0, structured_outputs={"json": SCHEMA}),
              SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)]
    outs = llm.generate(prompts, params)
    llm.engine.add_request("aborted", [3] * 30, SamplingParams(max_tokens=50, ignore_eos=True))
    for _ in range(3):
        llm.engine.step()
    llm.engine.abort("aborted")
    while llm.engine.has_work():
        llm.engine.step()
    llm.engine.step()  # an empty step: the worker hears of the abort
    return llm, plans, held, outs


@pytest.mark.slow  # the recorded workload: ~6 s
def test_no_live_request_reaches_the_worker(recorded):
    llm, plans, _, _ = recorded
    assert any(p.grammar is not None for p in plans) and any(r.draft_token_ids for p in plans for r in p.prefills)
    for plan in plans:
        assert requests_in(plan) == [], plan
        pickle.loads(pickle.dumps(dataclasses.replace(plan, prefills=[dataclasses.replace(r, draft_probs=None)
                                                                      for r in plan.prefills])))
    assert requests_in(llm.engine.runner.batch) == []


@pytest.mark.slow  # the recorded workload: ~6 s
def test_a_sequence_is_sent_whole_once_then_by_deltas(recorded):
    llm, plans, held, outs = recorded
    introduced: dict[str, int] = {}
    for plan in plans:
        for new in plan.new_seqs:
            introduced[new.seq_id] = introduced.get(new.seq_id, 0) + 1
        for update in plan.updates:
            assert update.seq_id in introduced
            assert len(update.new_token_ids) <= 1 + NGRAM["num_speculative_tokens"]  # a step's tokens, never the prompt
    assert all(n == 1 for n in introduced.values()), introduced
    seq_ids = {f"{o.request_id}#{i}" if i else o.request_id for o in outs for i in range(len(o.samples or [o]))}
    assert seq_ids | {"aborted"} <= set(introduced)
    assert set(introduced) <= {sid for p in plans for sid in p.finished_ids}  # every one forgotten in the end
    assert llm.engine.runner.batch.seqs == {} and llm.engine.scheduler.worker_view.known == {}


@pytest.mark.slow  # the recorded workload: ~6 s
def test_the_workers_tokens_are_the_schedulers(recorded):
    """After each step the worker holds each scheduled sequence's tokens up to the last one the
    plans sent; a finished output's tokens are those the worker was told of, plus its last token."""
    _, plans, held, outs = recorded
    final = {}
    for state in held:
        final.update(state)
    for o in outs:
        for i, s in enumerate(o.samples or [o]):
            sid = f"{o.request_id}#{i}" if i else o.request_id
            tokens = final[sid]
            assert s.token_ids[:len(tokens) - len(s.prompt_token_ids)] == tokens[len(s.prompt_token_ids):]
