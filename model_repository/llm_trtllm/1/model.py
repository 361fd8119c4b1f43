"""The `llm_trtllm` model: the `llm` model in the TensorRT-LLM request format.

Triton's OpenAI frontend (for any backend but vLLM) and TensorRT-LLM clients send every input with
a batch dimension, [1, 1] where the vLLM backend's clients send [1]. One Triton model cannot take
both ranks (its config fixes the rank of each input; checked on 2.51), so this thin decoupled
model takes the batched form (max_batch_size 1, the same table of inputs and outputs) and passes
each request to `llm` through BLS: the batch dimension is dropped from the inputs and added back
to the outputs; the request parameters and the request id go along. There is one engine, in
`llm`; nothing here loads torch.

A client that cancels is seen at the next response (`is_cancelled`). The 2.51 stub cannot cancel
a BLS request, so the llm request is stopped the way an HTTP client stops one: a `stop` request
with its request id (one of our own when the client set none).
"""
import json
import sys
import threading
import uuid
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

REPO_ROOT = Path(__file__).resolve().parents[3]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from backend.worker.parent_watch import exit_with_parent, stacks_on_request  # noqa: E402
from templates.tensors import INPUTS, OUTPUTS  # noqa: E402

TARGET = "llm"
FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class TritonPythonModel:
    def initialize(self, args):
        exit_with_parent()  # a tritonserver killed abruptly must not leave this stub behind
        stacks_on_request()  # a load that hangs can be asked where it is
        self.output_names = [t.name for t in OUTPUTS]

    def execute(self, requests):
        # Each request waits on its BLS responses in a thread of its own; Triton's thread returns.
        for request in requests:
            threading.Thread(target=self._forward, args=(request,), daemon=True).start()
        return None

    def _forward(self, request):
        sender = request.get_response_sender()
        try:
            inputs = []
            for t in INPUTS:
                tensor = pb_utils.get_input_tensor_by_name(request, t.name)
                if tensor is not None:
                    inputs.append(pb_utils.Tensor(t.name, _unbatch(t.name, tensor.as_numpy())))
            stream = pb_utils.get_input_tensor_by_name(request, "stream")
            stream = bool(stream.as_numpy().reshape(-1)[0]) if stream is not None else False
            request_id = request.request_id() or f"llm_trtllm-{uuid.uuid4().hex}"
            bls = pb_utils.InferenceRequest(model_name=TARGET, inputs=inputs, request_id=request_id,
                                            requested_output_names=self.output_names,
                                            parameters=json.loads(request.parameters() or "{}"))
            last, cancelled = None, False
            for response in bls.exec(decoupled=True):  # read to the end, also once cancelled
                if cancelled:
                    continue
                if response.has_error():
                    sender.send(pb_utils.InferenceResponse(output_tensors=[], error=response.error()), flags=FINAL)
                    return
                tensors = [pb_utils.Tensor(t.name(), t.as_numpy()[np.newaxis]) for t in response.output_tensors()]
                if not tensors:
                    continue
                if sender.is_cancelled():
                    cancelled = True
                    _stop(request_id)
                elif stream:
                    sender.send(pb_utils.InferenceResponse(output_tensors=tensors))
                else:
                    last = tensors  # one answer: sent with the FINAL flag (HTTP generate needs that)
            if last is not None and not cancelled:
                sender.send(pb_utils.InferenceResponse(output_tensors=last), flags=FINAL)
            else:
                sender.send(flags=FINAL)
        except Exception as exc:  # never leave a request without its FINAL response
            sender.send(pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(
                f"llm_trtllm: {type(exc).__name__}: {exc}")), flags=FINAL)


def _stop(request_id):
    """Stop llm's request `request_id` (its `stop` input), as a client of llm would."""
    stop = pb_utils.InferenceRequest(model_name=TARGET, inputs=[pb_utils.Tensor("stop", np.array([True]))],
                                     request_id=request_id, requested_output_names=["text_output"])
    for _ in stop.exec(decoupled=True):  # its one answer; an error means it had already ended
        pass


def _unbatch(name, array):
    """[1, ...] -> [...]: the batch dimension Triton checked against max_batch_size 1."""
    if array.ndim == 0 or array.shape[0] != 1:
        raise ValueError(f"{name}: the TensorRT-LLM format takes a batch of one; got shape {list(array.shape)}")
    return array[0]
