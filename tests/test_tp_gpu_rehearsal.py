"""Tensor-parallel groups on GPUs, rehearsed on the CPU as tests/test_gpu_rehearsal.py rehearses one
GPU: torch.cuda describes a 4-GPU machine (tests/fake_cuda.py) in rank 0's process and in its worker
(tests/fake_cuda_worker.py), and model.py's `initialize` gets what Triton passes the two instances
of `instance_group [{count: 2 kind: KIND_MODEL}]` with tensor_parallel_size 2 (what `inflight config
--tp 2` renders on 4 GPUs). Each instance's group must take its own two devices (llm_0_0: cuda:0
and cuda:1, llm_0_1: cuda:2 and cuda:3), with the real device selection, per-GPU locks, warm-up (in
lockstep on both ranks), KV sizing and the group's smallest capacity; only the tensors stay on the
CPU (so the group talks gloo) and torch.cuda's answers are fakes. Triton runs each instance in its
own process; here they run one after the other."""
import json
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from fake_cuda import GIB, MIB, FakeCuda, FakeGpu
from test_gpu_rehearsal import PARAMS, fake_pb_utils, tiny_model_dir  # noqa: F401 (the fixture)

ROOT = Path(__file__).resolve().parents[1]


def kind_model_args(model_dir: Path, repo: Path, instance: int) -> dict[str, str]:
    from google.protobuf import json_format

    from templates.render import apply_overrides, parse_config, render

    text = apply_overrides(render(gpus=[0, 1, 2, 3], tp=2), {**PARAMS, "model_path": str(model_dir)})
    assert "kind: KIND_MODEL" in text and "count: 2" in text
    config = json_format.MessageToDict(parse_config(text), preserving_proto_field_name=True)
    return {"model_config": json.dumps(config), "model_instance_kind": "MODEL",
            "model_instance_name": f"llm_0_{instance}", "model_instance_device_id": "0",
            "model_repository": str(repo), "model_version": "1", "model_name": "llm"}


@pytest.fixture
def four_gpus(monkeypatch, tmp_path):
    import backend.worker.parallel.launcher as launcher

    # rank 1's GPU (odd) has less free memory than rank 0's: the group must size to the smaller
    gpus = [FakeGpu(2 * GIB, 512 * MIB if i % 2 else 768 * MIB, 32 * MIB, 48 * MIB) for i in range(4)]
    cuda = FakeCuda(gpus=gpus).install(monkeypatch)
    monkeypatch.setenv("INFLIGHT_LOCK_DIR", str(tmp_path))
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", fake_pb_utils())
    monkeypatch.setattr(launcher, "WORKER_MODULE", "fake_cuda_worker")
    monkeypatch.setenv("PYTHONPATH", str(ROOT / "tests"))
    monkeypatch.setenv("FAKE_CUDA_GPUS", "4")
    import importlib.util
    spec = importlib.util.spec_from_file_location("inflight_tp_rehearsal_model", ROOT / "model_repository" / "llm" / "1" / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return cuda, module


@pytest.mark.slow
def test_two_kind_model_instances_with_tp2_take_disjoint_pairs_of_gpus(four_gpus, tmp_path, tiny_model_dir):
    from backend.kv.sizing import kv_bytes_per_token
    from backend.core.sampling_params import SamplingParams

    cuda, module = four_gpus
    for instance in (1, 0):
        cuda.calls.clear()
        model = module.TritonPythonModel()
        model.initialize(kind_model_args(tiny_model_dir, tmp_path / "repo", instance))
        try:
            runner = model.engine.engine.runner
            first, second = 2 * instance, 2 * instance + 1
            assert runner.device == torch.device("cuda", first) and cuda.current == first
            assert cuda.devices_used("set_device", "mem_get_info") == {first}     # rank 0 asked only its GPU
            assert runner.tp.backend == "gloo" and runner.tp.size == 2             # tensors on the CPU: gloo
            # rank 1 logs its cache once allocated, which may be after rank 0 has gone on
            deadline = time.monotonic() + 60
            while "KV cache: " not in "\n".join(runner.tp.workers.tails[1]) and time.monotonic() < deadline:
                time.sleep(0.05)
            worker_log = "\n".join(runner.tp.workers.tails[1])
            assert f"on cuda:{second};" in worker_log, worker_log                  # rank 1 on the next GPU
            # the group's cache: what the rank with the less free memory (rank 1, 512 MiB) holds
            per_block = runner.block_size * kv_bytes_per_token(runner.model_cfg, torch.bfloat16)
            gpu = cuda.gpus[second]
            assert runner.num_blocks == int(0.9 * (gpu.free - gpu.activation)) // per_block
            assert f"KV cache: {runner.num_blocks} blocks" in worker_log
            done, outputs = threading.Event(), []
            model.engine.add_request("r", [5, 6, 7, 8, 9], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True),
                                     lambda o: (outputs.append(o), o.finished and done.set()))
            assert done.wait(120) and len(outputs[-1].token_ids) == 3
        finally:
            model.finalize()
        assert runner.tp.workers.procs[1].poll() == 0     # told to stop, it exited cleanly
