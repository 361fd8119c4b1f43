"""The KV tiers go back to idle without new traffic: when `LLM.generate` has its outputs, the disk
writes of the last evictions may still be in flight (the disk tier writes on its own thread), and
nothing used to retire them until the next request's step. A slowed disk writer makes the window
certain (the clean-clone run met it once by chance, with the authenticated writer's extra work)."""
import random
import time

import pytest

from backend import LLM, SamplingParams
from backend.kv.tiers.disk import DiskStore
from hf_checkpoints import make_checkpoint
from test_kv_tiers import BLOCK_BYTES, ENGINE, assert_idle


@pytest.mark.slow  # ~4 s of CPU: a checkpoint and a slowed disk tier
def test_generate_returns_with_the_disk_tiers_writes_retired(tmp_path, monkeypatch):
    slow_write = DiskStore._write

    def write(self, key, src):
        time.sleep(0.05)
        return slow_write(self, key, src)

    monkeypatch.setattr(DiskStore, "_write", write)
    path = make_checkpoint("llama", tmp_path / "m", seed=5)
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randint(40, 90))] for _ in range(6)]
    llm = LLM(str(path), kv_host_cache_bytes=4 * BLOCK_BYTES, kv_disk_cache_dir=str(tmp_path / "disk"),
              kv_disk_cache_bytes=1 << 20, **ENGINE)
    try:
        llm.generate(prompts, SamplingParams(max_tokens=3, temperature=0))
        assert_idle(llm)
        assert llm.stats()["kv_tiers"]["disk"]["bytes_stored"] > 0  # blocks did go down to the disk
    finally:
        llm.close()
