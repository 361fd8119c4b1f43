"""Unloading a LoRA adapter that requests in flight hold never pulls it from under them. The offline
API (LLM.unload_lora) refuses, naming the adapter and how many requests hold it where (running,
queued, or waiting for their constraint to compile), and the adapter stays loaded; the serving
engine (AsyncEngine.unload_lora, what Triton's lora_action and /v1/unload_lora_adapter call) drains:
it unloads once the last of them, a compiling one included, has finished. vLLM's
/v1/unload_lora_adapter likewise lets in-flight requests finish. Either way every request ends with
the merged model's tokens (PEFT's merge_and_unload in transformers), never an error."""
from __future__ import annotations

import re
import threading

import pytest

from backend import LLM, SamplingParams
from backend.core.config import EngineConfig
from backend.engine.async_engine import AsyncEngine
from backend.models.make_model import make_model
from lora_adapters import make_adapter, merged_oracle

MAX_TOKENS = 6
PROMPTS = [[1, 17, 99, 305, 44, 12, 8, 1500, 77], [1, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20],
           [1, 400, 401, 402]]  # not block multiples
REGEX = "[ab]{1,5}"
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
CONSTRAINED = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, structured_outputs={"regex": REGEX})


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-unload")
    base = make_model(root / "base")
    return base, {"a": make_adapter(base, root / "a", seed=21)}


def run_out(llm) -> dict:
    """Step the engine until nothing is left; each request's final output by id."""
    done = {}
    while llm.engine.has_work():
        if not llm.engine.has_runnable_work():  # only constraints compiling: wait for one
            llm.engine.waitlist.wait(0.05)
        done.update((o.request_id, o) for o in llm.engine.step() if o.finished)
    return done


def test_the_offline_unload_refuses_while_requests_hold_the_adapter_and_names_them(tiny):
    base, adapters = tiny
    llm = LLM(str(base), enable_lora=True, max_loras=1, max_num_seqs=2, kv_block_size=16)
    llm.load_lora("a", str(adapters["a"]))
    # only a request whose constraint compiles holds it: not yet in the scheduler
    llm.engine.add_request("compiling", "hello", CONSTRAINED, lora_request="a")
    with pytest.raises(ValueError, match=r"^LoRA adapter 'a' is in use by 1 request\(s\) \(1 compiling their "
                                         r"constraint\); unload it once they finish$"):
        llm.unload_lora("a")
    assert llm.list_loras() == ["a"]
    out = run_out(llm)["compiling"]
    assert out.finish_reason in ("stop", "length") and re.fullmatch(REGEX, out.text), out
    # three greedy requests of a and one of the base model, two seats: two run, two queue
    for i, prompt in enumerate(PROMPTS):
        llm.engine.add_request(f"r{i}", prompt, GREEDY, lora_request="a")
    llm.engine.add_request("base", PROMPTS[0], GREEDY)
    with pytest.raises(ValueError, match=r"'a' is in use by 3 request\(s\) \(3 queued\)"):
        llm.unload_lora("a")
    done = {o.request_id: o for o in llm.engine.step() if o.finished}
    with pytest.raises(ValueError, match=r"'a' is in use by 3 request\(s\) \(2 running, 1 queued\)"):
        llm.unload_lora("a")
    done.update(run_out(llm))
    want = merged_oracle(base, adapters, PROMPTS + [PROMPTS[0]], ["a"] * 3 + [None], MAX_TOKENS)
    assert [list(done[r].token_ids) for r in ("r0", "r1", "r2", "base")] == want
    llm.unload_lora("a")  # nothing holds it now
    assert llm.list_loras() == []
    llm.check_integrity()


def test_the_serving_unload_waits_for_a_request_whose_constraint_compiles(tiny):
    base, adapters = tiny
    engine = AsyncEngine(EngineConfig(model_path=str(base), enable_lora=True, enable_runtime_lora=True, max_loras=1,
                                      kv_block_size=16, seed=0))
    try:
        engine.load_lora("a", str(adapters["a"]))
        finals, finished = {}, threading.Event()

        def on_output(out):
            if out.finished:
                finals[out.request_id] = out
                finished.set()
        engine.add_request("compiling", "hello", CONSTRAINED, on_output, lora_request="a")  # it alone holds a
        unloaded = engine.unload_lora("a")
        assert unloaded.wait(60) and finished.wait(60)
        out = finals["compiling"]
        assert out.finish_reason in ("stop", "length") and re.fullmatch(REGEX, out.text), out
        assert "a" not in engine.engine.runner.lora.names()
        with pytest.raises(ValueError, match=r"LoRA adapter 'a' is not loaded"):
            engine.add_request("late", PROMPTS[1], GREEDY, on_output, lora_request="a")
    finally:
        engine.shutdown()
