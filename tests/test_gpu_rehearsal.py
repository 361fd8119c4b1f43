"""The GPU path rehearsed on the CPU: torch.cuda patched to describe a 2-GPU machine
(tests/fake_cuda.py), and the Triton model's `initialize` fed exactly the `args` Triton's Python
backend passes a KIND_GPU instance on GPU 1 (python_backend's initialize map: model_config,
model_instance_kind as TRITONSERVER_InstanceGroupKindString writes it, model_instance_name,
model_instance_device_id, model_repository, model_version, model_name; all strings).

What runs is the real code: the adapter's instance-kind rule, device selection and binding, the
dtype rule, the per-GPU lock, the warm-up (a prefill, decode steps and the sampler, through the
Triton kernels under the interpreter), the KV sizing from that device's memory, the decode path
through the static buffers, and the metrics. Only the tensors stay on the CPU
(backend.worker.device.tensor_device_for) and torch.cuda's answers are the fake's.
"""
import fcntl
import importlib.util
import json
import os
import sys
import threading
import types
from pathlib import Path

import pytest
import torch

from fake_cuda import MIB, FakeCuda

ROOT = Path(__file__).resolve().parents[1]
MODEL_PY = ROOT / "model_repository" / "llm" / "1" / "model.py"
PARAMS = {"max_num_seqs": "4", "max_num_batched_tokens": "40", "max_model_len": "96", "kv_block_size": "16"}
FRACTION = 0.9
# The default model's architecture at gpu-check's dry-run size: the warm-up and the requests run
# the Triton kernels under the interpreter, whose time grows with the layers and heads; nothing
# checked here depends on the size (the cache is sized in bytes, per block of this model).
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16)


class _Metric:
    def __init__(self, family, labels, buckets=None):
        self.family, self.labels, self.value = family, labels, 0.0

    def set(self, value):
        self.value = value

    def increment(self, value):
        self.value += value

    def observe(self, value):
        self.value = value


class _MetricFamily:
    GAUGE, COUNTER, HISTOGRAM = "gauge", "counter", "histogram"
    created: list = []

    def __init__(self, name, description, kind):
        self.name, self.metrics = name, []
        _MetricFamily.created.append(self)

    def Metric(self, labels, buckets=None):  # noqa: N802 (pb_utils' name)
        metric = _Metric(self, dict(labels), buckets)
        self.metrics.append(metric)
        return metric


def fake_pb_utils() -> types.ModuleType:
    """The parts of triton_python_backend_utils that initialize and finalize use."""
    pb = types.ModuleType("triton_python_backend_utils")
    pb.MetricFamily = _MetricFamily
    pb.Logger = types.SimpleNamespace(log_info=lambda m: None, log_warn=lambda m: None, log_error=lambda m: None)
    pb.TritonModelException = type("TritonModelException", (Exception,), {})
    pb.using_decoupled_model_transaction_policy = lambda c: c.get("model_transaction_policy", {}).get("decoupled", False)
    pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
    return pb


def triton_args(model_dir: Path, repo: Path) -> dict[str, str]:
    """What Triton hands `initialize` for the second instance on GPU 1 of
    `instance_group [{count: 1 kind: KIND_GPU gpus: [0, 1]}]`: the config as JSON with proto field
    names (parameters as {"key": {"string_value": ...}}), the kind "GPU", the device id "1"."""
    from google.protobuf import json_format

    from templates.render import apply_overrides, parse_config, render

    text = apply_overrides(render(gpus=[0, 1]), {**PARAMS, "model_path": str(model_dir)})
    config = json_format.MessageToDict(parse_config(text), preserving_proto_field_name=True)
    return {"model_config": json.dumps(config), "model_instance_kind": "GPU", "model_instance_name": "llm_0_1",
            "model_instance_device_id": "1", "model_repository": str(repo), "model_version": "1",
            "model_name": "llm"}


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    from backend.models.make_model import make_model
    return make_model(tmp_path_factory.mktemp("tiny-model"), **TINY)


@pytest.fixture
def rehearsal(monkeypatch, tmp_path, tiny_model_dir):
    cuda = FakeCuda().install(monkeypatch)
    monkeypatch.setenv("INFLIGHT_LOCK_DIR", str(tmp_path))
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", fake_pb_utils())
    _MetricFamily.created = []
    spec = importlib.util.spec_from_file_location("inflight_rehearsal_model", MODEL_PY)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return cuda, module, triton_args(tiny_model_dir, tmp_path / "model_repository" / "llm")


@pytest.mark.slow
def test_a_kind_gpu_instance_on_gpu_1_selects_sizes_and_reports_cuda_1(rehearsal, tmp_path):
    cuda, module, args = rehearsal
    from backend.kv.sizing import kv_bytes_per_token
    from backend.worker import memory as memory_module
    from backend.worker.memory import lock_path

    held_while_sizing = []
    measure = memory_module.measure

    def measure_checking_the_lock(env, warm_up):
        fd = os.open(lock_path(env.identity()), os.O_RDONLY | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            held_while_sizing.append(False)
        except BlockingIOError:
            held_while_sizing.append(True)     # another open file holds it: the engine's
        finally:
            os.close(fd)
        return measure(env, warm_up)

    memory_module.measure = measure_checking_the_lock
    model = module.TritonPythonModel()
    try:
        model.initialize(args)
        runner = model.engine.engine.runner
        # the instance kind "GPU" and device id "1" -> cuda:1, bound on the engine thread
        assert runner.device == torch.device("cuda", 1) and cuda.current == 1
        assert ("set_device", 1) in cuda.calls
        # every memory question went to GPU 1, none to GPU 0
        memory_calls = ("mem_get_info", "memory_allocated", "max_memory_allocated", "reset_peak_memory_stats")
        assert cuda.devices_used(*memory_calls) == {1}
        # dtype auto on a compute capability 9.0 device: the float32 checkpoint runs in bfloat16
        assert runner.dtype == torch.bfloat16
        # the cache: 0.9 x (free - the warm-up's activation peak) of GPU 1, in whole blocks
        gpu = cuda.gpus[1]
        per_block = runner.block_size * kv_bytes_per_token(runner.model_cfg, torch.bfloat16)
        assert runner.num_blocks == int(FRACTION * (gpu.free - gpu.activation)) // per_block
        assert runner.num_blocks < int(FRACTION * gpu.free) // per_block     # the peak was not handed out
        assert held_while_sizing == [True]                                    # sized under the GPU's lock
        # the warm-up ran the kernels' paths and the graphs' static buffers serve decode steps
        assert runner.ops.name == "triton" and runner.decode_path.graphs is not None
        # every metric series says where the instance runs
        series = [m for f in _MetricFamily.created for m in f.metrics]
        assert series and all(m.labels["device"] == "cuda:1" and m.labels["instance"] == "llm_0_1" for m in series)
        # a request goes through (its tokens mean nothing: bfloat16 under the Triton interpreter)
        from backend.core.sampling_params import SamplingParams

        done = threading.Event()
        outputs = []
        model.engine.add_request("r", [5, 6, 7, 8, 9], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True),
                                 lambda o: (outputs.append(o), o.finished and done.set()))
        assert done.wait(120)
        assert len(outputs[-1].token_ids) == 3 and runner.decode_path.graphs.replays >= 2
    finally:
        memory_module.measure = measure
        model.finalize()


def test_the_old_kind_string_would_have_put_the_gpu_instance_on_the_cpu(rehearsal):
    """Triton passes "GPU": the adapter must read it as a GPU instance (it compared with
    "KIND_GPU" and served from the CPU)."""
    _, module, args = rehearsal
    config = module.adapter.engine_config({"model_path": json.loads(args["model_config"])["parameters"]
                                           ["model_path"]["string_value"]},
                                          args["model_instance_kind"], args["model_instance_device_id"], ROOT)
    assert config.device == "cuda:1"


@pytest.mark.slow
def test_a_gpu_too_small_for_the_activations_fails_with_the_numbers(rehearsal):
    cuda, module, args = rehearsal
    cuda.gpus[1].free = 32 * MIB          # less than the 48 MiB activation peak
    model = module.TritonPythonModel()
    with pytest.raises(RuntimeError, match=r"no GPU memory left for the KV cache on cuda:1: 0.03 GiB free.*0.05 GiB"):
        model.initialize(args)
