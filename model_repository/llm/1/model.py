"""The `llm` model: a thin decoupled Triton Python-backend adapter around the inflight engine.

initialize: config.pbtxt parameters -> EngineConfig, one AsyncEngine on the instance's device.
execute:    each request's tensors are validated and handed to the engine with its response
            sender; returns None at once. Responses go out from adapter.Frontend's thread.
finalize:   stops the engine loop; every request still open gets its FINAL response.
The logic lives in adapter.py beside this file (no Triton imports there, so it is unit-tested).
"""
import json
import sys
import threading
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parents[2]  # model_repository/llm/1 -> the repository root
for path in (str(HERE), str(REPO_ROOT)):
    if path not in sys.path:
        sys.path.insert(0, path)

import triton_python_backend_utils as pb_utils  # noqa: E402

import adapter  # noqa: E402
from triton_metrics import Metrics  # noqa: E402

INPUTS = adapter.INPUT_NAMES

STOP_FILE = ".inflight-stopping"  # serving/triton_launcher.py creates it in its run copy before stopping Triton


def triton_error(error):
    """adapter.Error (a message with a code name) -> pb_utils.TritonError with that code."""
    code = getattr(pb_utils.TritonError, getattr(error, "code", "INTERNAL"), pb_utils.TritonError.INTERNAL)
    return pb_utils.TritonError(str(error), code)


def respond(sender, tensors, error, final):
    flags = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0
    if tensors is None and error is None:
        sender.send(flags=flags)
        return
    if error is not None:
        response = pb_utils.InferenceResponse(output_tensors=[], error=triton_error(error))
    else:
        response = pb_utils.InferenceResponse(
            output_tensors=[pb_utils.Tensor(name, value) for name, value in tensors.items()])
    sender.send(response, flags=flags)


class TritonPythonModel:
    def initialize(self, args):
        from backend.worker.parent_watch import exit_with_parent, stacks_on_request
        exit_with_parent()  # a tritonserver killed abruptly must not leave this stub behind
        stacks_on_request()  # a load that hangs can be asked where it is
        config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(config):
            raise pb_utils.TritonModelException(
                "the llm model must be decoupled: model_transaction_policy { decoupled: true }")
        params = {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}
        try:
            engine_config = adapter.engine_config(params, args["model_instance_kind"],
                                                  args["model_instance_device_id"], REPO_ROOT,
                                                  args.get("model_instance_name", ""))
        except ValueError as exc:
            raise pb_utils.TritonModelException(f"config.pbtxt: {exc}") from None

        from backend.engine.async_engine import AsyncEngine  # torch loads here, after the config is known good

        try:
            self.engine = AsyncEngine(engine_config)
        except ValueError as exc:  # a size, adapter or checkpoint that does not fit: the reason, no traceback
            raise pb_utils.TritonModelException(f"inflight: {exc}") from None
        self.faults = adapter.FaultInjector.from_env(Path(args["model_repository"]))
        if self.faults is not None:  # tests only: see adapter.FaultInjector
            self.faults.install(self.engine)
            pb_utils.Logger.log_warn(f"inflight: FAULT INJECTION IS ARMED ({adapter.FAULT_ENV}=1): model steps "
                                     f"fail on demand through {self.faults.path}. For tests only.")
        labels = Metrics.instance_labels(args, self.engine.device)  # the device as resolved: cuda:1
        self.metrics = Metrics(labels, pb_utils.MetricFamily)
        self.metrics.describe(engine_config.kv_block_size, self.engine.stats()["kv_blocks_total"],
                              engine_config.max_loras if engine_config.enable_lora else 0)
        self.model_name = args["model_name"]
        self.frontend = adapter.Frontend(self.engine, respond, self.metrics,
                                         stop_file=Path(args["model_repository"]) / STOP_FILE,
                                         stream_interval=engine_config.stream_interval,
                                         on_engine_failure=self.take_out_of_service,
                                         runtime_lora=engine_config.enable_runtime_lora)
        from backend.core.gc_heap import freeze_heap
        frozen = freeze_heap()  # last of the start: no full collection walks the loaded model's objects again
        pb_utils.Logger.log_info(
            f"inflight: {args['model_instance_name']} on {self.engine.device}, model {engine_config.model_path}, "
            f"max_model_len {self.engine.max_model_len}, vocab {self.engine.vocab_size}, "
            f"KV blocks {self.engine.stats()['kv_blocks_total']}, weights: {self.engine.engine.runner.weights.summary}"
            + (f", CPU threads {len(self.engine.cpu_placement)} on cores {self.engine.cpu_placement} (OMP_NUM_THREADS "
               "sets the count)" if self.engine.cpu_placement else ""))
        pb_utils.Logger.log_info(adapter.engine_report(engine_config, self.engine.cpu_placement, frozen))

    def take_out_of_service(self, reason):
        """The engine stopped serving (a lost tensor-parallel rank, an unrecoverable fault): unload
        this model so Triton reports it not ready, as the vLLM backend does with an unhealthy
        engine. That needs --model-control-mode=explicit (`inflight serve` runs Triton so); in
        other modes the model stays loaded and refuses every request with UNAVAILABLE, which the
        liveness check (deploy/docker/healthcheck.py) reports."""
        pb_utils.Logger.log_error(f"inflight: the engine stopped serving: {reason}")

        def unload():
            try:
                pb_utils.unload_model(self.model_name)
                pb_utils.Logger.log_error(f"inflight: model '{self.model_name}' unloaded: it reports not ready")
            except Exception as exc:
                pb_utils.Logger.log_error(f"inflight: model '{self.model_name}' cannot unload itself ({exc}); it "
                                          "refuses every request with UNAVAILABLE until the server restarts")

        threading.Thread(target=unload, name="inflight-unload", daemon=True).start()

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                inputs = {}
                for name in INPUTS:
                    tensor = pb_utils.get_input_tensor_by_name(request, name)
                    inputs[name] = tensor.as_numpy() if tensor is not None else None
                parameters = request.parameters()
            except UnicodeDecodeError as exc:  # Triton's JSON passes "\ud800" on as bytes UTF-8 refuses
                respond(sender, None, adapter.Error(f"the request parameters are not valid UTF-8 text (a lone "
                                                    f"surrogate such as \\ud800?): {exc}", "INVALID_ARG"), True)
                continue
            self.frontend.submit(request.request_id(), inputs, sender, parameters,
                                 frozenset(request.requested_output_names()))
        return None

    def finalize(self):
        frontend = getattr(self, "frontend", None)
        if frontend is not None:
            frontend.close()
