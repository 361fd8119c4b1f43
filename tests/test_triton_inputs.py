"""triton_inputs.parse_request without a server: the vLLM backend's ways to send sampling settings
(the sampling_parameters tensor, else the request parameters; explicit tensors win), the
TensorRT-LLM format ([1, 1] shapes, its input names), the return_* flags, and refusals that name
the input and the rule. Value limits are SamplingParams' (one validation path): here only that
they reach the client."""
import json
import math

import numpy as np
import pytest

from adapter_module import load_adapter
from backend.core.sampling_params import SamplingParams
from templates import tensors as T

adapter = load_adapter()
parse = adapter.parse_request


def S(*values):
    return np.array([v.encode() if isinstance(v, str) else v for v in values], dtype=np.object_)


def one(value, dtype, trtllm=False):
    return np.array([[value]] if trtllm else [value], dtype=dtype)


def test_text_prompt_with_every_option_as_a_tensor():
    parsed = parse({
        "text_input": S("Hello"), "max_tokens": one(7, np.int32), "temperature": one(0.5, np.float32),
        "top_k": one(3, np.int32), "top_p": one(0.9, np.float32), "seed": one(11, np.uint64),
        "stop_words": S("a", "bc"), "ignore_eos": one(True, np.bool_), "min_tokens": one(2, np.int32),
        "stream": one(True, np.bool_), "exclude_input_in_output": one(True, np.bool_),
        "repetition_penalty": one(1.5, np.float32), "presence_penalty": one(0.5, np.float32),
        "frequency_penalty": one(-0.5, np.float32), "bad_words": S("x"), "priority": one(-3, np.int32),
        "return_finish_reason": one(True, np.bool_), "return_logprobs": one(False, np.bool_),
        "input_ids": None,
    })
    assert parsed.prompt == "Hello" and parsed.stream and parsed.exclude_input and not parsed.stop
    p = parsed.params
    assert (p.max_tokens, p.top_k, p.seed, p.stop, p.ignore_eos, p.min_tokens) == (7, 3, 11, ["a", "bc"], True, 2)
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty, p.bad_words) == (1.5, 0.5, -0.5, ["x"])
    assert math.isclose(p.temperature, 0.5) and math.isclose(p.top_p, 0.9, rel_tol=1e-6)
    assert parsed.priority == -3 and parsed.returns == {"return_finish_reason"}


def test_defaults_and_token_ids():
    parsed = parse({"input_ids": np.array([1, 2, 99], dtype=np.int32)})
    assert parsed.prompt == [1, 2, 99] and parsed.params.max_tokens == adapter.DEFAULT_MAX_TOKENS
    assert not parsed.stream and not parsed.exclude_input and parsed.returns == frozenset()


def test_sampling_parameters_json_values_may_be_strings_and_tensors_win():
    parsed = parse({"text_input": S("x"), "temperature": one(0.25, np.float32),
                    "sampling_parameters": S(json.dumps({"max_tokens": "5", "temperature": "0", "stop": "z",
                                                         "n": "2", "logprobs": 3, "ignore_eos": "true",
                                                         "priority": 4}))})
    p = parsed.params
    assert (p.max_tokens, p.stop, p.n, p.logprobs, p.ignore_eos) == (5, ["z"], 2, 3, True)
    assert p.temperature == 0.25 and parsed.priority == 4


def test_request_parameters_are_the_sampling_settings_without_the_tensor():
    """The vLLM backend's samples/client.py and its CI tests send them so (gRPC parameters=)."""
    params = json.dumps({"temperature": "0.1", "top_p": "0.95", "max_tokens": 9, "id": "42",
                         "triton_enable_empty_final_response": True})
    p = parse({"text_input": S("x")}, params).params
    assert (p.max_tokens, math.isclose(p.temperature, 0.1), math.isclose(p.top_p, 0.95)) == (9, True, True)
    # With the tensor present the parameters are ignored (as the vLLM backend), but still spelt right.
    both = parse({"text_input": S("x"), "sampling_parameters": S('{"max_tokens": 3}')},
                 json.dumps({"max_tokens": 9, "temperature": "0"}))
    assert both.params.max_tokens == 3 and both.params.temperature == 1.0
    with pytest.raises(ValueError, match="request parameters: unknown input.s. or sampling key.s. 'max_token'.*spelling"):
        parse({"text_input": S("x"), "sampling_parameters": S("{}")}, json.dumps({"max_token": 9}))


def test_beam_search_on_both_formats():
    """TensorRT-LLM's beam_width (every beam returned, temperature 0 unless sent) and the vLLM
    backend's use_beam_search (best_of beams, n returned) become the same SamplingParams."""
    p = parse({"text_input": S("a"), "beam_width": one(4, np.int32), "len_penalty": one(0.5, np.float32),
                       "early_stopping": one(True, np.bool_)}).params
    assert (p.use_beam_search, p.beam_width, p.n, p.temperature, p.length_penalty, p.early_stopping) == \
        (True, 4, 4, 0.0, 0.5, True)
    p = parse({"text_input": S("a"), "beam_width": one(4, np.int32),
                       "num_return_sequences": one(2, np.int32)}).params
    assert (p.beam_width, p.n) == (4, 2)
    p = parse({"text_input": S("a"), "sampling_parameters": S(
        '{"use_beam_search": "true", "best_of": 3, "n": 2, "length_penalty": 2, "early_stopping": "never"}')}).params
    assert (p.use_beam_search, p.beam_width, p.n, p.temperature, p.length_penalty, p.early_stopping) == \
        (True, 3, 2, 0.0, 2.0, "never")
    assert not parse({"text_input": S("a"), "beam_width": one(1, np.int32)}).params.use_beam_search


def test_the_tensorrt_llm_format_one_by_one_shapes_and_names():
    """As Triton's OpenAI frontend builds it for a non-vLLM backend (seed UINT64), and genai-perf's
    TensorRT-LLM converter (min_length)."""
    t = dict(trtllm=True)
    parsed = parse({"text_input": np.array([[b"Hi"]], dtype=np.object_), "stream": one(True, np.bool_, **t),
                    "max_tokens": one(6, np.int32, **t), "stop_words": np.array([[b"a", b"b"]], dtype=np.object_),
                    "top_p": one(0.5, np.float32, **t), "temperature": one(0.0, np.float32, **t),
                    "seed": one(7, np.uint64, **t), "presence_penalty": one(0.1, np.float32, **t),
                    "frequency_penalty": one(0.2, np.float32, **t), "exclude_input_in_output": one(True, np.bool_, **t),
                    "return_num_input_tokens": one(True, np.bool_, **t),
                    "return_num_output_tokens": one(True, np.bool_, **t),
                    "random_seed": one(8, np.uint64, **t), "runtime_top_k": one(4, np.int32, **t),
                    "min_length": one(2, np.int32, **t), "beam_width": one(1, np.int32, **t),
                    "num_return_sequences": one(2, np.int32, **t), "end_id": one(5, np.int32, **t),
                    "pad_id": one(0, np.int32, **t), "len_penalty": one(1.0, np.float32, **t)})
    p = parsed.params
    assert parsed.prompt == "Hi" and parsed.stream and p.stop == ["a", "b"] and p.max_tokens == 6
    assert (p.seed, p.top_k, p.min_tokens, p.n, p.stop_token_ids, p.ignore_eos) == (8, 4, 2, 2, [5], True)
    assert parsed.returns == {"return_num_input_tokens", "return_num_output_tokens"}
    assert parse({"input_ids": np.array([[1, 2]], np.int32)}).prompt == [1, 2]


BAD = [
    ({}, "no prompt"),
    ({"max_tokens": one(3, np.int32)}, "no prompt"),
    ({"text_input": S("a"), "input_ids": np.array([1], np.int32)}, "either text_input or input_ids"),
    ({"text_input": S("")}, "text_input is empty"),
    ({"text_input": np.array([b"\xff\xfe"], dtype=np.object_)}, "UTF-8"),
    ({"text_input": np.array([3], np.int32)}, "text_input must be a BYTES"),
    ({"input_ids": np.array([[1, 2], [3, 4]], np.int32)}, "one-dimensional"),
    ({"input_ids": np.array([1.0], np.float32)}, "input_ids must be an INT32"),
    ({"text_input": S("a"), "max_tokens": np.array([1, 2], np.int32)}, "exactly one value"),
    ({"text_input": S("a"), "max_tokens": one(1.5, np.float32)}, "max_tokens must be a TYPE_INT32"),
    ({"text_input": S("a"), "stream": one(1, np.int32)}, "stream must be a TYPE_BOOL"),
    ({"text_input": S("a"), "stop_words": S(*["w"] * 65)}, "stop_words: at most 64"),
    ({"text_input": S("a"), "sampling_parameters": S("{nope")}, "not valid JSON"),
    ({"text_input": S("a"), "sampling_parameters": S("[1]")}, "must be a JSON object"),
    ({"text_input": S("a"), "sampling_parameters": S('{"beam_widht": 2}')}, "unknown input.s. or sampling key.s. 'beam_widht'"),
    ({"text_input": S("a"), "sampling_parameters": S('{"best_of": 2}')}, "best_of .2. other than n .1. needs use_beam_search"),
    ({"text_input": S("a"), "sampling_parameters": S('{"use_beam_search": true, "best_of": 2, "temperature": 0.5}')},
     "^temperature .0.5. is not supported with beam search"),
    ({"text_input": S("a"), "sampling_parameters": S('{"logit_bias": {"3": 101}}')}, "^logit_bias must be a finite"),
    ({"text_input": S("a"), "sampling_parameters": S('{"min_p": 2}')}, "^min_p must be a finite number"),
    ({"text_input": S("a"), "sampling_parameters": S('{"stop": "a", "stop_words": "b"}')}, "not both"),
    ({"text_input": S("a"), "stream": one(True, np.bool_), "exclude_input_in_output": one(False, np.bool_)},
     "When streaming, `exclude_input_in_output` = False is not allowed."),
    ({"text_input": S("a"), "beam_width": one(0, np.int32)}, "beam_width must be an integer >= 1"),
    ({"text_input": S("a"), "beam_width": one(2, np.int32), "temperature": one(1.0, np.float32)},
     "^temperature .1.0. is not supported with beam search"),
    ({"text_input": S("a"), "priority": one(1.5, np.float32)}, "priority must be a TYPE_INT32"),
]


def test_return_log_probs_asks_the_engine_for_the_sampled_tokens_logprobs():
    """TensorRT-LLM's return_log_probs: the output flag, and the sampling key logprobs 0 unless
    more was asked (a top k kept)."""
    p = parse({"text_input": S("a"), "return_log_probs": one(True, np.bool_)})
    assert "return_log_probs" in p.returns and p.params.logprobs == 0
    p = parse({"text_input": S("a"), "return_log_probs": one(True, np.bool_), "sampling_parameters": S('{"logprobs": 3}')})
    assert p.params.logprobs == 3
    p = parse({"text_input": S("a"), "return_log_probs": one(True, np.bool_), "beam_width": one(2, np.int32)})
    assert p.params.use_beam_search and p.params.logprobs == 0
    p = parse({"text_input": S("a"), "return_log_probs": one(False, np.bool_)})
    assert "return_log_probs" not in p.returns and p.params.logprobs is None


@pytest.mark.parametrize("inputs,message", BAD, ids=[m for _, m in BAD])
def test_refusals_name_the_input_and_the_rule(inputs, message):
    with pytest.raises(ValueError, match=message):
        parse(inputs)


@pytest.mark.parametrize("field,value", [("max_tokens", 0), ("temperature", -0.1), ("top_p", 0.0),
                                         ("top_k", -2), ("min_tokens", 99), ("logprobs", 21), ("n", 0),
                                         ("repetition_penalty", 0.0)])
def test_value_limits_are_samplingparams_own_messages(field, value):
    """The one validation path: the same message as SamplingParams gives, from a tensor or JSON."""
    with pytest.raises(ValueError) as expected:
        SamplingParams.from_dict({field: value})
    with pytest.raises(ValueError) as got:
        parse({"text_input": S("a"), "sampling_parameters": S(json.dumps({field: value}))})
    assert str(got.value) == str(expected.value) and field in str(got.value)
    with pytest.raises(ValueError) as got:
        parse({"text_input": S("a")}, json.dumps({field: value}))
    assert str(got.value) == str(expected.value)


def test_byte_caps_run_before_decoding():
    with pytest.raises(ValueError, match="text_input is 11 bytes; the limit is 10 bytes"):
        parse({"text_input": S("x" * 11)}, max_input_bytes=10)
    from triton_inputs import MAX_SAMPLING_PARAMETERS_BYTES
    big = np.array([b"{" + b" " * MAX_SAMPLING_PARAMETERS_BYTES + b"}"], dtype=np.object_)
    with pytest.raises(ValueError, match="sampling_parameters is .* bytes; the limit"):
        parse({"text_input": S("a"), "sampling_parameters": big})


def test_stop_request_needs_nothing_else():
    assert parse({"stop": one(True, np.bool_)}).stop


def test_every_input_of_the_table_is_read_and_is_in_the_rendered_config():
    from templates import render as R

    config = R.parse_config(R.render(gpus=[]).split("\n", 1)[1])
    rendered = {i.name: (i.data_type, list(i.dims)) for i in config.input}
    from tritonclient.grpc import model_config_pb2

    table = {t.name: (model_config_pb2.DataType.Value("TYPE_" + t.data_type), list(t.dims)) for t in T.INPUTS}
    assert rendered == table and set(adapter.INPUT_NAMES) == set(table)
    assert [o.name for o in config.output] == [t.name for t in T.OUTPUTS]


def test_the_committed_trtllm_config_is_the_rendered_one():
    from templates import render as R

    assert R.TRTLLM_CONFIG.read_text() == R.render_trtllm(), "re-render: python -c 'from templates import " \
        "render as R; R.TRTLLM_CONFIG.write_text(R.render_trtllm())'"
    config = R.parse_config(R.render_trtllm())
    assert config.max_batch_size == 1 and config.model_transaction_policy.decoupled
    assert [i.name for i in config.input] == [t.name for t in T.INPUTS]


@pytest.mark.parametrize("top_k, penalty", [(-1, 3.0), (0, 0.05), (5, 10.0)])
def test_one_rule_for_top_k_and_repetition_penalty_on_every_path(top_k, penalty):
    """vLLM's rule everywhere: top_k -1 (or 0) is off, any repetition_penalty > 0 is allowed. The
    tensors, the sampling_parameters JSON and the request parameters all reach SamplingParams,
    and the OpenAI server sends the value through unchanged (it has no rule of its own)."""
    from openai_server.translate import parse_completion

    paths = [parse({"text_input": S("a"), "top_k": one(top_k, np.int32),
                    "repetition_penalty": one(penalty, np.float32)}),
             parse({"text_input": S("a"), "sampling_parameters": S(json.dumps(
                 {"top_k": top_k, "repetition_penalty": penalty}))}),
             parse({"text_input": S("a")}, json.dumps({"top_k": top_k, "repetition_penalty": penalty}))]
    for parsed in paths:
        assert parsed.params.top_k == top_k
        assert math.isclose(parsed.params.repetition_penalty, penalty, rel_tol=1e-6)
    gen = parse_completion({"model": "llm", "prompt": "a", "top_k": top_k, "repetition_penalty": penalty})
    assert (gen.sampling["top_k"], gen.sampling["repetition_penalty"]) == (top_k, penalty)
    assert SamplingParams.from_dict(gen.sampling).top_k == top_k
