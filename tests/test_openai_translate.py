"""The OpenAI server's translation, without a server: OpenAI bodies -> Triton tensors (checked by
the engine's SamplingParams, errors naming the OpenAI parameter), Triton responses laid out as the
vLLM backend lays them out -> OpenAI choices, usage, logprobs and chunks; error statuses from the
engine's own messages; chat prompts from a checkpoint's template."""
import json
import shutil

import numpy as np
import pytest

from backend.core.sampling_params import SamplingParams
from openai_server.chat_render import ChatRenderer
from openai_server.responses import ChoiceState, Reply, parse_logprobs, pieces, usage
from openai_server.translate import (DEFAULT_CHAT_MAX_TOKENS, APIError, parse_chat, parse_completion,
                                            triton_tensors)
from openai_server.triton_backend import error_status

ALL_RETURNS = frozenset({"text_input", "input_ids", "stream", "exclude_input_in_output", "sampling_parameters",
                         "return_finish_reason", "return_num_input_tokens", "return_num_output_tokens",
                         "return_logprobs", "return_cumulative_logprob"})


def _sent(tensors, name):
    array, _ = tensors[name]
    return array.reshape(-1)[0]


def test_completion_becomes_the_engine_settings_and_tensors():
    gen = parse_completion({"model": "llm", "prompt": "Hello", "max_tokens": 7, "temperature": 0.5,
                            "top_p": 0.9, "seed": 11, "stop": "\n", "presence_penalty": 0.5,
                            "frequency_penalty": -0.5, "logprobs": 3, "ignore_eos": True, "user": "me"})
    tensors = triton_tensors(gen, 0, ALL_RETURNS)
    assert _sent(tensors, "text_input") == b"Hello"
    assert bool(_sent(tensors, "exclude_input_in_output")) is True
    sampling = json.loads(_sent(tensors, "sampling_parameters"))
    assert sampling == {"max_tokens": 7, "temperature": 0.5, "top_p": 0.9, "seed": 11, "stop": ["\n"],
                        "presence_penalty": 0.5, "frequency_penalty": -0.5, "logprobs": 3, "ignore_eos": True}
    params = SamplingParams.from_dict(sampling)  # what the model will build from it
    assert (params.max_tokens, params.logprobs, params.stop) == (7, 3, ["\n"])
    assert {n for n in tensors if n.startswith("return_")} == {
        "return_finish_reason", "return_num_input_tokens", "return_num_output_tokens", "return_logprobs"}


def test_return_switches_only_where_the_model_declares_them():
    gen = parse_completion({"model": "llm", "prompt": [5, 6, 7], "n": 3})
    tensors = triton_tensors(gen, 0, frozenset({"input_ids", "sampling_parameters"}))
    assert not [n for n in tensors if n.startswith("return_")]
    assert tensors["input_ids"][0].tolist() == [5, 6, 7] and tensors["input_ids"][1] == "INT32"
    assert json.loads(_sent(tensors, "sampling_parameters"))["n"] == 3
    with pytest.raises(APIError, match="return_logprobs") as err:
        triton_tensors(parse_completion({"model": "llm", "prompt": "x", "logprobs": 1}), 0, frozenset())
    assert err.value.param == "logprobs"


def test_several_prompts_number_their_choices_prompt_by_prompt():
    gen = parse_completion({"model": "llm", "prompt": ["a", "b"], "n": 2})
    assert gen.num_choices == 4 and gen.prompts == ["a", "b"]
    assert _sent(triton_tensors(gen, 1, ALL_RETURNS), "text_input") == b"b"


@pytest.mark.parametrize("body, param", [
    ({"top_p": 3}, "top_p"),
    ({"temperature": "hot"}, "temperature"),
    ({"temperature": -1}, "temperature"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"n": 0}, "n"),
    ({"n": 100}, "n"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": float("inf")}, "frequency_penalty"),
    ({"seed": -1}, "seed"),
    ({"stop": [1, 2]}, "stop"),
    ({"logprobs": 21}, "logprobs"),
    ({"logprobs": 2, "n": 2}, "logprobs"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"best_of": 3}, "best_of"),
    ({"use_beam_search": True, "best_of": 2, "temperature": 0.7}, "temperature"),
    ({"use_beam_search": True, "n": 3, "best_of": 2}, "n"),
    ({"use_beam_search": "yes"}, "use_beam_search"),
    ({"use_beam_search": True, "early_stopping": "sometimes"}, "early_stopping"),
    ({"use_beam_search": True, "best_of": 2, "stop": ["x"]}, "stop"),
    ({"suffix": "end"}, "suffix"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"five": 1}}, "logit_bias"),
    ({"logit_bias": [5]}, "logit_bias"),
    ({"min_p": 1.5}, "min_p"),
    ({"allowed_token_ids": [-1]}, "allowed_token_ids"),
    ({"allowed_token_ids": "5"}, "allowed_token_ids"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"skip_special_tokens": "no"}, "skip_special_tokens"),
    ({"max_token": 5}, "max_token"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": {"text": "x"}}, "prompt"),
])
def test_bad_completion_parameters_are_named(body, param):
    with pytest.raises(APIError) as err:
        parse_completion({"model": "llm", "prompt": "Hi", **body})
    assert err.value.status == 400 and err.value.param == param
    assert param in err.value.message
    assert err.value.body()["error"]["type"] == "invalid_request_error"


def test_echo_with_logprobs_asks_for_the_prompts_logprobs_at_the_same_k():
    """vLLM: the prompt's tokens then lead the choice's logprobs (echo_logprobs.py)."""
    gen = parse_completion({"model": "llm", "prompt": "Hi", "echo": True, "logprobs": 3})
    assert gen.echo and gen.logprobs == 3 and gen.sampling["prompt_logprobs"] == 3
    explicit = parse_completion({"model": "llm", "prompt": "Hi", "echo": True, "logprobs": 3, "prompt_logprobs": 1})
    assert explicit.sampling["prompt_logprobs"] == 1
    assert "prompt_logprobs" not in parse_completion({"model": "llm", "prompt": "Hi", "echo": True}).sampling


def test_beam_search_is_vllms_extra_parameters():
    gen = parse_completion({"model": "llm", "prompt": "Hi", "use_beam_search": True, "n": 2, "best_of": 4,
                            "length_penalty": 0.5, "early_stopping": "never"})
    assert gen.sampling == {"max_tokens": gen.sampling["max_tokens"], "use_beam_search": True, "best_of": 4,
                            "length_penalty": 0.5, "early_stopping": "never", "n": 2}
    assert SamplingParams.from_dict(gen.sampling).temperature == 0.0  # none sent: beams rank raw logprobs


def test_defaults_of_unsupported_fields_are_accepted():
    parse_completion({"model": "llm", "prompt": "Hi", "best_of": 1, "suffix": None, "logit_bias": None})
    parse_chat({"model": "llm", "messages": [{"role": "user", "content": "Hi"}], "tool_choice": "none",
                "tools": None}, lambda m: "x")


def _chat(render=lambda messages: [1, 2, 3], **body):
    return parse_chat({"model": "llm", "messages": [{"role": "user", "content": "Hi"}], **body}, render)


def test_chat_parameters():
    assert _chat().sampling["max_tokens"] == DEFAULT_CHAT_MAX_TOKENS
    assert _chat(max_tokens=9).sampling["max_tokens"] == 9
    assert _chat(max_tokens=9, max_completion_tokens=4).sampling["max_tokens"] == 4
    gen = _chat(logprobs=True, top_logprobs=2, stream=True, stream_options={"include_usage": True})
    assert (gen.logprobs, gen.sampling["logprobs"], gen.include_usage, gen.chat) == (2, 2, True, True)
    assert _chat(logprobs=True).logprobs == 0  # the sampled token's only
    assert _chat(logprobs=False).logprobs is None


@pytest.mark.parametrize("body, param", [
    ({"max_completion_tokens": -1}, "max_completion_tokens"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 25}, "top_logprobs"),
    ({"logprobs": 1}, "logprobs"),
    ({"messages": []}, "messages"),
    ({"messages": [{"content": "no role"}]}, "messages"),
    ({"messages": [{"role": "user", "content": None}]}, "messages"),
    ({"messages": [{"role": "user"}]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "messages"),
    ({"tools": [{"type": "function"}]}, "tools"),
    ({"response_format": {"type": "xml"}}, "response_format"),
])
def test_bad_chat_parameters_are_named(body, param):
    with pytest.raises(APIError) as err:
        _chat(**body)
    assert err.value.status == 400 and err.value.param == param


def test_chat_text_parts_are_joined_for_the_template():
    seen = []
    _chat(render=lambda m: seen.append(m) or [1],
          messages=[{"role": "user", "content": [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}]}])
    assert seen == [[{"role": "user", "content": "Hello"}]]


# -- responses -----------------------------------------------------------------------------------

def _getter(**outputs):
    arrays = {k: np.array(v, dtype=np.object_ if isinstance(v[0], (str, bytes)) else None)
              for k, v in outputs.items()}
    return lambda name: arrays.get(name)


def test_vllm_layout_with_n_completions():
    get = _getter(text_output=[b" a", b""], finish_reason=[b"None", b"length"], num_input_tokens=[5],
                  num_output_tokens=[1, 0])
    got = pieces(get, None)
    assert [(p.text, p.num_tokens, p.finish_reason, p.num_input_tokens) for p in got] == [
        (" a", 1, None, 5), ("", 0, "length", 5)]


def test_one_completion_counts_output_ids_and_reads_its_logprobs():
    lp = [{"7": {"logprob": -0.1, "rank": 1, "decoded_token": "x"}, "9": {"logprob": -2.5, "rank": 2, "decoded_token": "y"}},
          {"4": {"logprob": -0.2, "rank": 1, "decoded_token": "p"}, "8": {"logprob": -3.0, "rank": 4, "decoded_token": "q"}}]
    get = _getter(text_output=[b"xq"], output_ids=np.array([7, 8], dtype=np.int32), finish_reason=[b"stop"],
                  logprobs=[json.dumps(lp).encode()])
    (piece,) = pieces(get, 1)
    assert piece.num_tokens == 2 and piece.finish_reason == "stop"
    first, second = piece.logprobs
    assert (first.token_id, first.logprob, first.text, first.top) == (7, -0.1, "x", [(7, -0.1, "x")])
    # the sampled token outside the top 1 is still the token's logprob; the top is the best-ranked
    assert (second.token_id, second.logprob, second.text, second.top) == (8, -3.0, "q", [(4, -0.2, "p")])
    assert parse_logprobs("null", [1], 2) == []


def test_choice_state_ignores_a_finished_completion_repeated():
    state = ChoiceState()
    get = _getter(text_output=[b"ab"], finish_reason=[b"length"], num_output_tokens=[2], num_input_tokens=[3])
    assert state.add(pieces(get, None)[0]) is True
    assert state.add(pieces(get, None)[0]) is False
    assert (state.text, state.num_output_tokens, state.finish_reason) == ("ab", 2, "length")


def test_usage_counts_each_prompt_once():
    states = [ChoiceState(num_input_tokens=4, num_output_tokens=k) for k in (1, 2)] + \
             [ChoiceState(num_input_tokens=6, num_output_tokens=k) for k in (3, 4)]
    assert usage(states, 2) == {"prompt_tokens": 10, "completion_tokens": 10, "total_tokens": 20}


def test_chunks_and_bodies_have_openai_shapes():
    reply = Reply("chatcmpl-1", "llm", chat=True)
    state = ChoiceState()
    (piece,) = pieces(_getter(text_output=[b"Hi"], finish_reason=[b"None"], num_output_tokens=[1]), None)
    state.add(piece)
    first = reply.chunk(0, piece, state, True, False, True)
    assert first["object"] == "chat.completion.chunk" and first["usage"] is None
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": "Hi"}
    assert first["choices"][0]["finish_reason"] is None
    assert "role" not in reply.chunk(0, piece, state, False, False, False)["choices"][0]["delta"]
    body = reply.body([state], 1, False)
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "Hi"}
    assert body["usage"] == {"prompt_tokens": 0, "completion_tokens": 1, "total_tokens": 1}
    text = Reply("cmpl-1", "llm", chat=False).body([state], 1, False, ["Say: "])
    assert text["object"] == "text_completion" and text["choices"][0]["text"] == "Say: Hi"


# -- error statuses from the messages the model sends ----------------------------------------------

def test_error_status_of_the_engines_messages(default_model_dir):
    from backend import LLM
    from backend.core.errors import QueueFullError

    llm = LLM(str(default_model_dir), max_queue_size=1)
    llm.engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=2))
    with pytest.raises(QueueFullError) as full:
        llm.engine.add_request("b", [1, 2, 3], SamplingParams(max_tokens=2))
    assert error_status(str(full.value)) == 429
    with pytest.raises(ValueError) as bad:
        SamplingParams(top_k=-2)
    assert error_status(str(bad.value)) == 400
    assert error_status("the server is shutting down; retry later") == 503
    assert error_status("RuntimeError: CUDA error: an illegal memory access") == 500


# -- chat templates --------------------------------------------------------------------------------

def _with_template(src, dst, template):
    shutil.copytree(src, dst)
    config = json.loads((dst / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (dst / "tokenizer_config.json").write_text(json.dumps(config))
    return dst


def test_chat_prompt_is_the_rendered_template_without_an_added_bos(default_model_dir, tmp_path):
    from backend.text.tokenizer import Tokenizer

    template = "{% for m in messages %}<s>[{{ m.role }}] {{ m.content }}\n{% endfor %}[assistant]"
    path = _with_template(default_model_dir, tmp_path / "m", template)
    ids = ChatRenderer(str(path))([{"role": "user", "content": "Hello there"}])
    tok = Tokenizer.from_dir(path)
    assert ids == tok.encode("<s>[user] Hello there\n[assistant]", add_special_tokens=False)
    assert ids.count(tok.bos_token_id) == 1  # the template's own, and no second one


def test_chat_without_a_template_or_with_a_hostile_one_is_a_400(default_model_dir, tmp_path):
    with pytest.raises(APIError, match="no chat template") as err:
        ChatRenderer(str(default_model_dir))([{"role": "user", "content": "Hi"}])
    assert err.value.status == 400 and err.value.param == "messages"
    path = _with_template(default_model_dir, tmp_path / "h", "{{ messages.__class__.__mro__ }}")
    with pytest.raises(APIError, match="sandbox|unsafe|attribute") as err:
        ChatRenderer(str(path))([{"role": "user", "content": "Hi"}])
    assert err.value.status == 400
    with pytest.raises(APIError, match="--model-path") as err:
        ChatRenderer(None)([{"role": "user", "content": "Hi"}])


def test_queue_info_is_an_extension_off_by_default():
    from templates.tensors import QUEUE_INFO_OUTPUTS

    declared = ALL_RETURNS | {"return_queue_info"}
    assert "return_queue_info" not in triton_tensors(parse_completion({"model": "llm", "prompt": "a"}), 0, declared)
    gen = parse_completion({"model": "llm", "prompt": "a", "return_queue_info": True, "stream": True})
    assert bool(_sent(triton_tensors(gen, 0, declared), "return_queue_info"))
    assert "return_queue_info" not in json.loads(_sent(triton_tensors(gen, 0, declared), "sampling_parameters"))
    assert _chat(return_queue_info=True).queue_info
    with pytest.raises(APIError) as err:
        parse_completion({"model": "llm", "prompt": "a", "return_queue_info": "yes"})
    assert err.value.param == "return_queue_info"
    with pytest.raises(APIError, match="no queue info outputs"):
        triton_tensors(gen, 0, ALL_RETURNS)
    # a response with the outputs: every choice's piece carries them, and so do the chunk and body
    values = {name: [i] for i, name in enumerate(QUEUE_INFO_OUTPUTS)}
    got = pieces(_getter(text_output=["x"], finish_reason=["None"], **values), None)
    assert got[0].queue_info == {name: i for i, name in enumerate(QUEUE_INFO_OUTPUTS)}
    state = ChoiceState()
    state.add(got[0])
    reply = Reply("cmpl-1", "llm", chat=False)
    assert reply.chunk(0, got[0], state, True, False, False)["choices"][0]["queue_info"] == got[0].queue_info
    assert reply.body([state], 1, False)["choices"][0]["queue_info"] == got[0].queue_info
    plain = pieces(_getter(text_output=["x"], finish_reason=["None"]), None)[0]
    assert plain.queue_info is None and "queue_info" not in reply.chunk(0, plain, ChoiceState(), True, False, False)["choices"][0]
