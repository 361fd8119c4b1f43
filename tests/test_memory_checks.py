"""Sizes that cannot fit the memory there is are refused at start naming the key, the size asked and
what is available (backend/kv/sizing.py), not by the allocator: the KV cache (cpu_kv_cache_tokens,
max_tokens_in_paged_kv_cache, kv_block_size), max_num_seqs' block tables, the draft model's cache."""
from __future__ import annotations

import json
import re

import pytest

from backend import LLM, EngineConfig
from backend.kv import sizing
from backend.worker import memory
HUGE = 10 ** 13


@pytest.mark.parametrize("overrides, key", [
    ({"cpu_kv_cache_tokens": HUGE}, f"cpu_kv_cache_tokens: {HUGE} tokens of KV cache"),
    ({"max_tokens_in_paged_kv_cache": HUGE}, f"max_tokens_in_paged_kv_cache: {HUGE} tokens of KV cache"),
    ({"max_num_seqs": 10 ** 11}, "max_num_seqs: 100000000000 sequences' block tables"),
])
def test_a_size_past_the_memory_is_refused_naming_the_key(default_model_dir, overrides, key):
    with pytest.raises(ValueError) as err:
        LLM(str(default_model_dir), max_model_len=256, **overrides)
    message = str(err.value)
    assert message.startswith(key), message
    assert re.search(r"take [\d.]+ (GiB|MiB); [\d.]+ GiB of host memory available", message), message


def test_a_block_too_large_for_the_memory_names_kv_block_size(default_model_dir, monkeypatch):
    monkeypatch.setattr(memory, "available_bytes", lambda env: (1 << 20, "host memory available"))
    with pytest.raises(ValueError, match=r"^kv_block_size: one block of 1024 tokens of KV cache \(1 blocks of 1024 "
                                         r"tokens\) take [\d.]+ MiB; 1.0 MiB of host memory available"):
        LLM(str(default_model_dir), max_model_len=256, kv_block_size=1024, cpu_kv_cache_tokens=512)


def test_the_draft_models_cache_names_its_own_key(default_model_dir):
    spec = json.dumps({"model": str(default_model_dir), "num_speculative_tokens": 2, "draft_kv_cache_tokens": HUGE})
    with pytest.raises(ValueError, match=r"^speculative_config.draft_kv_cache_tokens: the draft model's "
                                         rf"{HUGE} tokens of KV cache .* GiB of host memory available"):
        LLM(str(default_model_dir), max_model_len=256, cpu_kv_cache_tokens=1024, speculative_config=spec)


def test_sizes_the_config_can_refuse_alone():
    with pytest.raises(ValueError, match=r"kv_block_size must be in \[1, 1024\] tokens; got 1000000000"):
        EngineConfig(kv_block_size=10 ** 9)
    for bad in ("0", "nan", "inf", "601"):
        with pytest.raises(ValueError, match=r"structured_outputs_compile_timeout_s must be in \(0, 600\] seconds"):
            EngineConfig.from_params({"structured_outputs_compile_timeout_s": bad})


def test_the_block_tables_count_every_kv_cache_group(monkeypatch):
    """A model with sliding-window layers keeps a block table per KV-cache group (backend/kv/groups.py)."""
    config = EngineConfig(max_num_seqs=1000)
    available = (1000 * 64 * 4 * 3, "host memory available")
    sizing.check_block_tables(config, 64, available, groups=3)   # three groups' tables fit exactly
    with pytest.raises(ValueError, match=r"^max_num_seqs: 1000 sequences' block tables \(64 blocks of 16 tokens "
                                         r"each in each of 4 KV-cache groups\) take 1.0 MiB; 0.7 MiB"):
        sizing.check_block_tables(config, 64, available, groups=4)


@pytest.mark.parametrize("tp", [1, 2])
def test_a_shut_down_engines_memory_is_free_when_the_next_one_sizes_its_cache(default_model_dir, tp):
    """An AsyncEngine shut down and dropped is freed at once, by reference counting: no reference
    cycle (its grammar wake-up callback on the engine's waitlist was one; with tensor parallelism,
    its rank-lost callback on the group) holds its KV cache until the cycle collector runs, which
    need not happen before the next engine measures the memory it may take. On the first H200 the
    next engine of one process found 19 MiB free of 140 GiB and died."""
    import gc
    import weakref

    from backend.engine.async_engine import AsyncEngine

    enabled = gc.isenabled()
    gc.disable()   # as if the collector had not come round before the next engine sizes its cache
    try:
        engine = AsyncEngine(EngineConfig(model_path=str(default_model_dir), max_model_len=256,
                                          tensor_parallel_size=tp))
        runner = weakref.ref(engine.engine.runner)
        engine.shutdown()
        del engine
        assert runner() is None
    finally:
        if enabled:
            gc.enable()
