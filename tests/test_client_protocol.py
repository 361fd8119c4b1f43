"""client/protocol.py without a server: requests ask for the outputs `Result` shows, `n` and
`logprobs` travel as request parameters, the tensor types are the model's table, and responses
are read the way the model now writes them (outputs only when asked, "None" while running,
num_output_tokens per response)."""
import json

import numpy as np

from client.protocol import OUTPUTS, TENSOR_TYPES, Chunk, Options, Result, request_json, request_tensors
from templates import tensors as T


def test_tensor_types_and_outputs_come_from_the_models_table():
    assert set(TENSOR_TYPES) == {t.name for t in T.INPUTS} and OUTPUTS == tuple(t.name for t in T.OUTPUTS)
    assert TENSOR_TYPES["seed"] == (np.uint64, "UINT64") and TENSOR_TYPES["text_input"] == (np.object_, "BYTES")


def test_requests_ask_for_what_the_result_shows():
    tensors = request_tensors("hi", Options(max_tokens=3, bad_words=["x"]), stream=True)
    asked = {name for name, (array, _) in tensors.items() if name.startswith("return_") and array[0]}
    assert asked == {"return_finish_reason", "return_num_input_tokens", "return_num_output_tokens"}
    assert list(tensors["bad_words"][0]) == [b"x"]
    with_logprobs = Options(logprobs=2, n=3)
    tensors = request_tensors("hi", with_logprobs, stream=False)
    assert {"return_logprobs", "return_cumulative_logprob"} <= set(tensors)
    assert "n" not in tensors and "logprobs" not in tensors  # no such inputs: request parameters
    assert with_logprobs.parameters() == {"n": 3, "logprobs": 2}
    body = request_json("hi", with_logprobs, stream=True)
    assert body["n"] == 3 and body["logprobs"] == 2 and body["return_logprobs"] is True
    assert request_json(None, Options(), False, "job", stop=True) == {"id": "job", "stop": True,
                                                                     "return_finish_reason": True}


def test_responses_are_read_per_response_and_running_is_none():
    step = Chunk.from_json({"text_output": "a", "output_ids": 7, "finish_reason": "None", "num_output_tokens": 1,
                            "num_input_tokens": 4, "logprobs": json.dumps([{"7": {"logprob": -0.5, "rank": 1,
                                                                                    "decoded_token": "a"}}]),
                            "cumulative_logprob": -0.5})
    last = Chunk.from_arrays({"text_output": np.array([b"b"], dtype=np.object_),
                              "output_ids": np.array([8], np.int32),
                              "finish_reason": np.array([b"length"], dtype=np.object_),
                              "num_output_tokens": np.array([1], np.uint32)}.get)
    assert not step.finished and step.finish_reason is None and last.finished
    result = Result()
    result.add(step)
    result.add(last)
    assert (result.text, result.token_ids, result.num_output_tokens, result.num_input_tokens) == ("ab", [7, 8], 2, 4)
    assert result.finish_reason == "length" and result.cumulative_logprob == -0.5 and len(result.logprobs) == 1
    two = Chunk.from_json({"text_output": ["x", "y"], "finish_reason": ["stop", "None"]})
    assert two.texts == ["x", "y"] and not two.finished


def test_integers_that_do_not_fit_their_input_are_refused_not_wrapped():
    """numpy wraps 4294967301 into an INT32 as 5, and Triton wraps a JSON number the same way: the
    client library refuses it, naming the value, for tensors and for HTTP JSON alike."""
    import pytest

    for build in (lambda p, o: request_tensors(p, o, stream=False), lambda p, o: request_json(p, o, False)):
        with pytest.raises(ValueError, match=r"input_ids: 4294967301 does not fit INT32"):
            build([1, 4294967301], Options())
        with pytest.raises(ValueError, match=r"input_ids: -2147483649 does not fit INT32"):
            build([-2147483649], Options())
        with pytest.raises(ValueError, match=r"max_tokens: 1000000000000 does not fit INT32"):
            build("hi", Options(max_tokens=10**12))
        with pytest.raises(ValueError, match=r"seed: -1 does not fit UINT64"):
            build("hi", Options(seed=-1))
    assert request_tensors([1, 2**31 - 1], Options(), stream=False)["input_ids"][0].tolist() == [1, 2**31 - 1]


def test_queue_info_is_a_switch_and_its_outputs_are_read():
    tensors = request_tensors("hi", Options(queue_info=True), stream=True)
    assert bool(tensors["return_queue_info"][0][0]) and "queue_info" not in tensors
    body = request_json("hi", Options(queue_info=True), stream=True)
    assert body["return_queue_info"] is True and "queue_info" not in body
    assert "return_queue_info" not in request_tensors("hi", Options(), stream=True)
    chunk = Chunk.from_json({"text_output": "", "output_ids": [], "queue_position": 2, "reserved_step": -1,
                             "engine_step": 9, "seconds_since_arrival": 0.25})
    assert chunk.queue == {"queue_position": 2, "reserved_step": -1, "engine_step": 9, "seconds_since_arrival": 0.25}
    assert Chunk.from_json({"text_output": "a"}).queue is None
    arrays = {"text_output": np.array([b""], dtype=np.object_), "queue_position": np.array([0], np.int32),
              "arrival_time_ns": np.array([17], np.int64)}
    assert Chunk.from_arrays(arrays.get).queue == {"queue_position": 0, "arrival_time_ns": 17}
