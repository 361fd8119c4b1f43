"""Structured outputs and tool calling on SmolLM2-135M-Instruct through the real servers, started as
`make serve` starts them (`inflight serve`, tritonserver and its OpenAI port), one for this module:
15 sampled JSON-schema answers (nested object, array of an enum, bounded integer, pattern) that all
validate where 5 of the same asked unconstrained do not, and 32 regex and 32 choice answers the same
(8 unconstrained of each do not);
the official `openai` SDK parsing response_format and tool calls (required and named, streamed and
not) into its own types; a second turn with a `tool` message; the vLLM backend's guided-choice
request over Triton gRPC and HTTP; bad constraints refused with a 400 while the server serves on and
holds no KV block."""
from __future__ import annotations

import json
import re
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import jsonschema
import pytest

from serving.triton_launcher import free_port

from .conftest import inflight_serve, requires_tritonserver, stop_serve, wait_until
from .raw_requests import array, grpc_stream, http_generate

openai = pytest.importorskip("openai")
pydantic = pytest.importorskip("pydantic")
pytestmark = requires_tritonserver

N = 32          # the server's max_num_seqs: one full batch (50 took two)
N_SCHEMA = 15   # one batch (50 took 62 s of the suite; at 15 all validate, all distinct, 0 of 15 unconstrained do)
# Unconstrained answers only show that the prompt alone does not make the format: a few are enough.
N_FREE = 8
N_FREE_SCHEMA = 5
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "minLength": 2, "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "pets": {"type": "array", "items": {"enum": ["cat", "dog", "fish"]}, "maxItems": 3},
    "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                  "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"]}},
    "required": ["name", "age", "pets", "address"]}
PHONE = r"\(\d{3}\) \d{3}-\d{4}"
MOODS = ["positive", "negative", "neutral"]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 20}},
                   "required": ["zone"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]


@pytest.fixture(scope="module")
def served():
    """`inflight serve` on SmolLM2 (what `make serve` runs) on free ports, stopped at the end."""
    from smollm2 import smollm2_dir

    ports = {name: free_port() for name in ("http", "grpc", "metrics", "openai")}
    proc, _ = inflight_serve(
        ["--model-path", str(smollm2_dir()), "--host", "127.0.0.1", "--http-port", str(ports["http"]),
         "--grpc-port", str(ports["grpc"]), "--metrics-port", str(ports["metrics"]),
         "--openai-port", str(ports["openai"]), "--tool-call-parser", "hermes", "--param", "max_model_len=1024",
         "--param", "max_num_seqs=32", "--param", "cpu_kv_cache_tokens=16384"], timeout=300)
    try:
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{ports['openai']}/v1", api_key="unused", max_retries=0,
                            timeout=300), ports
    finally:
        stop_serve(proc)


def kv_blocks_used(ports) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{ports['metrics']}/metrics", timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("inflight_kv_blocks{") and 'state="used"' in line)


def fan_out(call, n=N):
    with ThreadPoolExecutor(32) as pool:   # the server's max_num_seqs: one full batch, fewer steps
        return list(pool.map(call, range(n)))


def _person_prompt(i):
    return [{"role": "user", "content": f"Invent person number {i}: give their name, age, pets and address "
                                        "(city and zip code) as JSON."}]


def test_fifteen_schema_answers_validate_and_unconstrained_ones_do_not(served):
    api, _ = served
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}

    def ask(i, constrained=True):
        kw = {"response_format": fmt} if constrained else {}
        return api.chat.completions.create(model="llm", messages=_person_prompt(i), max_tokens=100,
                                           temperature=0.8, seed=i, **kw).choices[0]

    def valid(text):
        try:
            jsonschema.validate(json.loads(text), PERSON)
            return True
        except (ValueError, jsonschema.ValidationError):
            return False

    constrained = fan_out(ask, N_SCHEMA)
    assert all(c.finish_reason == "stop" for c in constrained), [c.message.content for c in constrained]
    assert all(valid(c.message.content) for c in constrained)
    assert len({c.message.content for c in constrained}) > N_SCHEMA // 2  # sampled answers, not one
    free = fan_out(lambda i: ask(i, constrained=False), N_FREE_SCHEMA)
    assert not all(valid(c.message.content) for c in free)


def test_a_batch_of_regex_and_choice_answers_match_and_unconstrained_ones_do_not(served):
    api, _ = served

    def complete(i, extra, prompt, max_tokens):
        return api.completions.create(model="llm", prompt=prompt, max_tokens=max_tokens, temperature=1.0, seed=i,
                                      extra_body=extra).choices[0].text

    phone = "My phone number, written as (123) 456-7890, is"
    regex = fan_out(lambda i: complete(i, {"guided_regex": PHONE}, phone, 20))
    assert all(re.fullmatch(PHONE, t) for t in regex), regex
    assert not all(re.fullmatch(PHONE, t) for t in fan_out(lambda i: complete(i, {}, phone, 20), N_FREE))
    review = "Review: the food was cold and late. Sentiment (positive, negative or neutral):"
    choice = fan_out(lambda i: complete(i, {"structured_outputs": {"choice": MOODS}}, review, 8))
    assert set(choice) <= set(MOODS)
    assert not all(t in MOODS for t in fan_out(lambda i: complete(i, {}, review, 8), N_FREE))


class Person(pydantic.BaseModel):
    name: str
    age: int
    pets: list[Literal["cat", "dog", "fish"]]


class GetWeather(pydantic.BaseModel):
    city: str
    unit: Literal["celsius", "fahrenheit"]


class GetTime(pydantic.BaseModel):
    zone: str


def test_the_sdk_parses_response_format_into_its_model(served):
    api, _ = served
    parsed = api.chat.completions.parse(model="llm", messages=_person_prompt(1), response_format=Person,
                                        max_tokens=120, temperature=0)
    person = parsed.choices[0].message.parsed
    assert isinstance(person, Person) and person.name and set(person.pets) <= {"cat", "dog", "fish"}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", ["required", "named"])
def test_the_sdk_reads_enforced_tool_calls(served, stream, choice):
    api, _ = served
    tools = [openai.pydantic_function_tool(GetWeather, name="get_weather"),
             openai.pydantic_function_tool(GetTime, name="get_time")]
    tool_choice = "required" if choice == "required" else {"type": "function", "function": {"name": "get_weather"}}
    kwargs = dict(model="llm", messages=ASK, tools=tools, tool_choice=tool_choice, max_tokens=80,
                  temperature=0, parallel_tool_calls=False)
    if stream:
        with api.chat.completions.stream(**kwargs) as events:
            deltas = [e for e in events if e.type == "tool_calls.function.arguments.delta" and e.arguments_delta]
            final = events.get_final_completion()
        assert len(deltas) > 1  # the arguments arrived in pieces
    else:
        final = api.chat.completions.parse(**kwargs)
    message = final.choices[0].message
    assert len(message.tool_calls) == 1 and message.tool_calls[0].id.startswith("call_")
    call = message.tool_calls[0].function
    assert call.name == "get_weather" or choice == "required"
    assert isinstance(call.parsed_arguments, {"get_weather": GetWeather, "get_time": GetTime}[call.name])
    assert final.choices[0].finish_reason == ("stop" if choice == "named" else "tool_calls")


def test_a_second_turn_with_the_tools_result(served):
    from backend.text.tokenizer import Tokenizer
    from openai_server.tools import ToolCalling
    from smollm2 import smollm2_dir

    api, _ = served
    first = api.chat.completions.create(model="llm", messages=ASK, tools=[WEATHER], tool_choice="required",
                                        max_tokens=60, temperature=0).choices[0].message
    call = first.tool_calls[0]
    history = ASK + [first.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"}]
    second = api.chat.completions.create(model="llm", messages=history, tools=[WEATHER], max_tokens=40,
                                         temperature=0)
    assert second.choices[0].message.content and not second.choices[0].message.tool_calls
    # the result reached the prompt, rendered by the documented default (SmolLM2's template has no tools)
    tok = Tokenizer.from_dir(smollm2_dir())
    tools = ToolCalling.from_body({"tools": [WEATHER]}, "hermes")
    text = tok.render_chat(tools.tools_in_system_message(history, tools.template_tools()))
    assert "<tool_response>\n18 degrees and sunny\n</tool_response>" in text
    assert second.usage.prompt_tokens == len(tok.encode(text, add_special_tokens=False))


def test_the_vllm_backends_guided_choice_request(served):
    _, ports = served
    sampling = json.dumps({"temperature": 0, "top_p": 1, "max_tokens": 8,
                           "structured_outputs": json.dumps({"choice": ["Positive", "Negative"]})})
    prompt = "Classify intent of the sentence: Harry Potter is underrated. "
    responses = grpc_stream(f"127.0.0.1:{ports['grpc']}", {"text_input": array(prompt),
                                                            "sampling_parameters": array(sampling),
                                                            "exclude_input_in_output": array(True)})
    assert [r["text_output"][0].decode() for r in responses][-1] in ("Positive", "Negative")
    answer = http_generate(f"127.0.0.1:{ports['http']}", {"text_input": prompt, "sampling_parameters": sampling,
                                                          "exclude_input_in_output": True}, stream=False)
    assert answer[0]["text_output"] in ("Positive", "Negative")
    with pytest.raises(RuntimeError, match=r"structured_outputs\.regex: cannot be compiled"):
        grpc_stream(f"127.0.0.1:{ports['grpc']}", {"text_input": array(prompt), "sampling_parameters": array(
            json.dumps({"structured_outputs": json.dumps({"regex": "(unclosed"})}))})


@pytest.mark.parametrize("kwargs, param, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
     "response_format", "structured_outputs.json: /type must be one of"),  # checked at the door
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "array", "uniqueItems": True}}}}, "response_format", "cannot enforce these JSON-schema keywords"),
    ({"extra_body": {"guided_regex": "(ab"}}, None, "structured_outputs.regex: cannot be compiled"),
    ({"extra_body": {"guided_grammar": 'root ::= root "a"'}}, None, "tokenizer cannot satisfy"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "not among the tools"),
])
def test_bad_constraints_are_a_400_and_the_server_serves_on(served, kwargs, param, words):
    api, ports = served
    with pytest.raises(openai.BadRequestError) as err:
        api.chat.completions.create(model="llm", messages=ASK, max_tokens=8, **kwargs)
    assert words in err.value.body["message"] and err.value.body["param"] == param
    assert api.chat.completions.create(model="llm", messages=ASK, max_tokens=2).choices[0].finish_reason
    wait_until(lambda: kv_blocks_used(ports) == 0, timeout=30)
