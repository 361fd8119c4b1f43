"""KV-cache sizing on a GPU (backend/kv/sizing.py): the documented formula, the measurement order
(no cached memory handed back between the warm-up and the read of free memory), and engines on
one GPU sizing one after another (two processes, the real lock)."""
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from backend.kv import sizing as kv_sizing
from backend.worker import memory
from backend.worker.device import DeviceEnv
from fake_cuda import MIB, FakeCuda

ROOT = Path(__file__).resolve().parents[1]


def test_the_cache_gets_the_fraction_of_free_memory_minus_the_activation_peak():
    mem = kv_sizing.GpuMemory(free=10 * 2**30, total=16 * 2**30, activation=2 * 2**30)
    assert kv_sizing.blocks_that_fit(mem, 0.9, 2**20, "cuda:0") == int(0.9 * 8 * 2**30) // 2**20
    with pytest.raises(RuntimeError, match="cuda:0: 1.00 GiB free.*2.00 GiB.*max_num_batched_tokens"):
        kv_sizing.blocks_that_fit(kv_sizing.GpuMemory(2**30, 2**31, 2 * 2**30), 0.9, 2**20, "cuda:0")


def test_free_memory_is_read_before_the_warm_up_and_its_peak_after(monkeypatch):
    """The order of calls on the device: cached blocks released and free memory read, then the
    peak statistics reset, the warm-up, and the peak read; nothing released after the warm-up (that
    would hand the activations' memory to the cache)."""
    cuda = FakeCuda().install(monkeypatch)
    env = DeviceEnv.for_device(torch.device("cuda", 1))
    ran = []
    mem = memory.measure(env, lambda: ran.append(len(cuda.calls)))
    names = [name for name, _ in cuda.calls]
    warm_up_at = ran[0]
    assert names[:warm_up_at] == ["synchronize", "empty_cache", "mem_get_info", "reset_peak_memory_stats",
                                  "memory_allocated"]
    assert "empty_cache" not in names[warm_up_at:] and "max_memory_allocated" in names[warm_up_at:]
    gpu = cuda.gpus[1]
    assert mem == kv_sizing.GpuMemory(gpu.free, gpu.total, gpu.activation)
    assert cuda.devices_used("mem_get_info", "max_memory_allocated") == {1}


SIZER = textwrap.dedent("""
    import json, sys, time, torch
    from backend.kv import sizing as kv_sizing
    from backend.worker import memory
    from backend.worker.device import DeviceEnv
    state = sys.argv[1]
    class Env(DeviceEnv):            # one GPU shared by the processes: its free memory is a file
        def identity(self):
            return "GPU-shared"
    env = Env(torch.device("cuda", 0), torch.device("cpu"))
    with memory.one_engine_at_a_time(env):
        free = json.load(open(state))["free"]
        time.sleep(0.5)              # loading and warming up: the other engine starts meanwhile
        blocks = kv_sizing.blocks_that_fit(kv_sizing.GpuMemory(free, 2**31, 0), 0.5, 2**20, "cuda:0")
        json.dump({"free": free - blocks * 2**20}, open(state, "w"))   # the cache is allocated
    print(blocks)
""")


@pytest.mark.slow
def test_two_engines_on_one_gpu_size_one_after_another(tmp_path):
    """Triton loads the instances of `count: 2` in parallel processes: each must see what the other
    left, so with fraction 0.5 they get 1/2 and 1/4 of the memory, not 1/2 each (which would not fit)."""
    state = tmp_path / "gpu.json"
    state.write_text(json.dumps({"free": 1024 * 2**20}))
    env = dict(os.environ, INFLIGHT_LOCK_DIR=str(tmp_path))
    procs = [subprocess.Popen([sys.executable, "-c", SIZER, str(state)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [r[1][-2000:] for r in results]
    assert sorted(int(out) for out, _ in results) == [256, 512]
    assert json.loads(state.read_text())["free"] == 256 * 2**20


def test_the_lock_is_per_gpu_and_released_when_the_holder_exits(tmp_path, monkeypatch):
    monkeypatch.setenv("INFLIGHT_LOCK_DIR", str(tmp_path))

    class Env(DeviceEnv):
        def __init__(self, name):
            super().__init__(torch.device("cuda", 0), torch.device("cpu"))
            self.name = name

        def identity(self):
            return self.name

    start = time.monotonic()
    with memory.one_engine_at_a_time(Env("GPU-a")):
        with memory.one_engine_at_a_time(Env("GPU-b")):   # another GPU: no wait
            pass
    assert time.monotonic() - start < 5
    assert memory.lock_path("GPU-a").exists() and memory.lock_path("GPU-a").parent == tmp_path
    with memory.one_engine_at_a_time(DeviceEnv(torch.device("cpu"), torch.device("cpu"))):
        pass                                                  # the CPU takes no lock
    assert sorted(p.name for p in tmp_path.iterdir()) == ["inflight-gpu-GPU-a.lock", "inflight-gpu-GPU-b.lock"]


def test_the_warm_up_runs_the_largest_prefill_decode_steps_and_the_sampler(monkeypatch, tmp_path, default_model_dir):
    """What the activation peak is measured over: a prefill of the whole token budget, decode steps
    of max_num_seqs rows and of one, and the sampler on max_num_seqs rows with every option on;
    all between the peak reset and the peak read, on the engine's GPU."""
    from backend.worker import runner as runner_module
    from backend.core.config import EngineConfig
    from backend.models.loader import load_model_config
    from backend.core.sampling_params import MAX_LOGPROBS

    cuda = FakeCuda().install(monkeypatch)
    monkeypatch.setenv("INFLIGHT_LOCK_DIR", str(tmp_path))
    steps, sampled = [], []
    from backend.worker import sample_step as sample_module
    run, sample = runner_module.ModelRunner.execute, sample_module.sample

    def recording_run(self, plan):
        steps.append((len(cuda.calls), [r.num_new_tokens for r in plan.prefills], len(plan.decodes)))
        return run(self, plan)

    def recording_sample(logits, requests, masks=None):
        sampled.append(requests)
        return sample(logits, requests, masks)

    monkeypatch.setattr(runner_module.ModelRunner, "execute", recording_run)
    monkeypatch.setattr(sample_module, "sample", recording_sample)
    config = EngineConfig(model_path=str(default_model_dir), device="cuda:1", attention_backend="torch",
                          max_num_seqs=6, max_num_batched_tokens=40, max_tokens_in_paged_kv_cache=512)
    runner = runner_module.ModelRunner(config, load_model_config(str(default_model_dir)), 128)
    assert [(p, d) for _, p, d in steps] == [([40], 0), ([], 6), ([], 1)]
    names = [name for name, _ in cuda.calls]
    reset, peak = names.index("reset_peak_memory_stats"), names.index("max_memory_allocated")
    assert all(reset < calls_before <= peak for calls_before, _, _ in steps)
    biggest = max(sampled, key=len)
    p = biggest[0].params
    assert len(biggest) == 6 and p.logprobs == MAX_LOGPROBS and p.top_p < 1 and p.top_k > 0
    assert p.repetition_penalty != 1 and p.frequency_penalty and p.presence_penalty and p.min_tokens
    assert runner.num_blocks == 512 // 16 and runner.kv_caches[0][0].shape[0] == 32   # the explicit size wins
