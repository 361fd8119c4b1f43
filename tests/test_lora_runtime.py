"""Adapters loaded and unloaded at run time in the serving engine (AsyncEngine, issue 43 item 5):
an unload drains (new requests naming the adapter are refused at once, running ones finish with
the merged oracle's tokens, then it is unloaded and its slot freed), a load while others run, and
every refusal of a load naming why, through the same checks as at start (peft_format.py,
manager.py). The doors' part: test_lora_runtime_doors.py; a real server: e2e/test_lora_runtime.py."""
from __future__ import annotations

import shutil
import threading
import time

import pytest

from backend.core.config import EngineConfig
from backend.core.sampling_params import SamplingParams
from backend.engine.async_engine import AsyncEngine
from backend.models.make_model import make_model
from lora_adapters import AdapterSpec, make_adapter, merged_oracle

MAX_TOKENS = 24
PROMPTS = [[1, 17, 99, 305, 44, 12, 8, 1500, 77], [1, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21],
           [1, 400, 401, 402], [1, 900, 33, 21, 8, 8, 8, 31, 1201, 6, 77, 3, 1999]]  # not block multiples


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-runtime")
    base = make_model(root / "base")
    adapters = {"a": make_adapter(base, root / "a", seed=11),
                "b": make_adapter(base, root / "b", seed=12, spec=AdapterSpec(r=4, targets=("q_proj", "down_proj"), b_std=0.1)),
                "big": make_adapter(base, root / "big", seed=13, spec=AdapterSpec(r=32, targets=("o_proj",)))}
    return base, adapters


@pytest.fixture(scope="module")
def engine(tiny):
    base, adapters = tiny
    eng = AsyncEngine(EngineConfig(model_path=str(base), enable_lora=True, enable_runtime_lora=True, max_loras=2,
                                   max_cpu_loras=2, max_lora_rank=16, kv_block_size=16, seed=0))
    yield eng
    eng.shutdown()


def wait_for(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


class Collect:
    """Outputs by request id; `done[rid]` is set at its final output."""

    def __init__(self):
        self.tokens: dict[str, list[int]] = {}
        self.reasons: dict[str, str] = {}
        self.done: dict[str, threading.Event] = {}

    def add(self, engine, rid, prompt, lora=None):
        self.done[rid] = threading.Event()

        def on_output(out, rid=rid):
            if out.finished:
                self.tokens[rid], self.reasons[rid] = list(out.token_ids), out.finish_reason
                self.done[rid].set()
        engine.add_request(rid, prompt, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True),
                           on_output, lora_request=lora)

    def wait(self, *rids, timeout=120):
        for rid in rids:
            assert self.done[rid].wait(timeout), f"{rid} never finished"


@pytest.mark.slow  # the module's engine and PEFT adapters (~11 s), the merged oracle
def test_unload_drains_its_requests_refuses_new_ones_and_a_load_joins_while_others_run(tiny, engine):
    base, adapters = tiny
    got = Collect()
    engine.load_lora("a", str(adapters["a"]))
    assert engine.engine.loras.names() == ["a"]
    names = ["a", None, "a", None]
    for i, (prompt, name) in enumerate(zip(PROMPTS, names)):
        got.add(engine, f"r{i}", prompt, name)
    done = engine.unload_lora("a")
    assert not done.is_set()  # its two requests hold it: 24 steps to go
    with pytest.raises(ValueError, match=r"LoRA adapter 'a' is not loaded \(it is being unloaded\)"):
        got.add(engine, "late", PROMPTS[0], "a")
    assert "a" not in engine.engine.loras.names()  # listed no more from the moment the unload began
    assert engine.unload_lora("a") is done  # a second unload waits on the same drain
    # a load while the others run: its requests join the running batch
    engine.load_lora("b", str(adapters["b"]))
    got.add(engine, "rb", PROMPTS[1], "b")
    assert done.wait(120)
    got.wait("r0", "r1", "r2", "r3", "rb")
    # nothing lost: every request ran to its end with the merged model's tokens, a's included
    want = merged_oracle(base, adapters, PROMPTS + [PROMPTS[1]], names + ["b"], MAX_TOKENS)
    assert [got.tokens[r] for r in ("r0", "r1", "r2", "r3", "rb")] == want
    assert set(got.reasons.values()) == {"length"}
    manager = engine.engine.runner.lora
    assert "a" not in manager.names() and engine.engine.loras.names() == ["b"]
    got.add(engine, "after", PROMPTS[2], None)  # a step after the unload frees a's device slot
    got.wait("after")
    assert "a" not in manager.bank.holder
    with pytest.raises(ValueError, match=r"LoRA adapter 'a' is not loaded; loaded adapters: b"):
        got.add(engine, "gone", PROMPTS[0], "a")
    with pytest.raises(ValueError, match=r"LoRA adapter 'a' is not loaded"):
        engine.unload_lora("a")
    engine.unload_lora("b").wait(30)
    wait_for(lambda: engine.stats()["lora_unloads_total"] == 2)  # the metrics' snapshot follows the unload
    stats = engine.stats()
    assert stats["lora_loads_total"] == 2  # a and b; the refused late request loaded nothing
    assert stats["kv_blocks_used"] == 0 and stats["num_requests_running"] == 0


@pytest.mark.slow  # the module's engine and PEFT adapters (~11 s), the merged oracle
def test_a_runtime_load_is_checked_as_at_start_and_refused_naming_why(tiny, engine, tmp_path):
    base, adapters = tiny
    with pytest.raises(ValueError, match=r"'big' \(\S+\): module 'layers\.0\.self_attn\.o_proj' has rank 32, "
                                         r"above max_lora_rank=16"):
        engine.load_lora("big", str(adapters["big"]))
    with pytest.raises(ValueError, match=r"LoRA adapter 'none' \(\S+\): no adapter folder there"):
        engine.load_lora("none", str(tmp_path / "nowhere"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"LoRA adapter 'empty' \(\S+\): .*adapter_config\.json"):
        engine.load_lora("empty", str(tmp_path / "empty"))
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    shutil.copy(adapters["a"] / "adapter_config.json", pickled)
    (pickled / "adapter_model.bin").write_bytes(b"\x80\x04not really a pickle")
    with pytest.raises(ValueError, match=r"adapter_model\.bin is a pickle and is never loaded"):
        engine.load_lora("pickled", str(pickled))
    with pytest.raises(ValueError, match=r"'llm' is named like the served model"):
        engine.load_lora("llm", str(adapters["a"]))
    engine.load_lora("x", str(adapters["a"]))
    with pytest.raises(ValueError, match=r"'x' is already loaded from \S+; unload it first"):
        engine.load_lora("x", str(adapters["b"]))
    engine.load_lora("y", str(adapters["b"]))
    with pytest.raises(ValueError, match=r"LoRA adapter 'z': 2 adapters are loaded \(x, y\), the most max_cpu_loras "
                                         r"allows \(2\); unload one first"):
        engine.load_lora("z", str(adapters["b"]))
    for name in ("x", "y"):
        assert engine.unload_lora(name).wait(30)
    assert engine.engine.loras.names() == []


def test_runtime_lora_needs_enable_lora_and_max_cpu_loras_at_least_max_loras():
    with pytest.raises(ValueError, match="enable_runtime_lora needs enable_lora=true"):
        EngineConfig(enable_runtime_lora=True)
    with pytest.raises(ValueError, match=r"max_cpu_loras must be 0 \(no limit\) or >= max_loras \(2\); got 1"):
        EngineConfig(enable_lora=True, max_loras=2, max_cpu_loras=1)
