"""The OpenAI-compatible server against a real tritonserver, with the official `openai` SDK as the
client: the tiny model (the session's server) for completions, usage, logprobs, n, errors and the
disconnect; SmolLM2-135M-Instruct (made the way `make model` makes it) for chat."""
import pytest

from serving.openai_launcher import OpenAIServer
from serving.triton_launcher import free_port

from .conftest import MAX_MODEL_LEN, requires_tritonserver, wait_until
from .series import gauge

openai = pytest.importorskip("openai")
pytestmark = requires_tritonserver


def sdk(api_server):
    return openai.OpenAI(base_url=f"{api_server.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def api(server, model_path):
    with OpenAIServer(server.grpc_url, model_path) as api_server:  # as `inflight serve` starts it
        yield sdk(api_server)


GREEDY = dict(model="llm", temperature=0)


def counts(usage):
    """A usage's token counts; its prompt_tokens_details.cached_tokens depend on what ran before."""
    return usage.prompt_tokens, usage.completion_tokens, usage.total_tokens


# -- completions on the tiny model -------------------------------------------------------------------

def test_models_lists_the_served_model(api):
    assert [m.id for m in api.models.list().data] == ["llm"]


def test_completion_matches_the_engine_and_the_stream_joins_to_it(api, llm):
    prompt, max_tokens = "Once upon a time", 12
    ref = llm.greedy(prompt, max_tokens)
    whole = api.completions.create(prompt=prompt, max_tokens=max_tokens, **GREEDY)
    assert whole.choices[0].text == ref.text
    assert whole.choices[0].finish_reason == ref.finish_reason
    # usage: the tokenizer's counts (the engine's prompt ids, BOS included) and the tokens generated
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(ref.prompt_token_ids), len(ref.token_ids))
    assert whole.usage.total_tokens == len(ref.prompt_token_ids) + len(ref.token_ids)

    chunks = list(api.completions.create(prompt=prompt, max_tokens=max_tokens, stream=True,
                                         stream_options={"include_usage": True}, **GREEDY))
    text_chunks = [c for c in chunks if c.choices]
    assert len(text_chunks) > 1
    assert "".join(c.choices[0].text for c in text_chunks) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == ref.finish_reason
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert chunks[-1].choices == [] and counts(chunks[-1].usage) == counts(whole.usage)
    assert all(c.usage is None for c in text_chunks)
    # the second time, the prompt's full blocks come from the prefix cache (on by default)
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 16 * ((len(ref.prompt_token_ids) - 1) // 16)


def test_logprobs_are_the_engines_and_greedy_picks_the_top_one(api, llm):
    out = api.completions.create(prompt="The quick brown fox", max_tokens=6, logprobs=3, **GREEDY)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == out.usage.completion_tokens == 6
    assert "".join(lp.tokens) == out.choices[0].text
    for sampled, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 3 and sampled <= 0
        assert sampled == pytest.approx(max(top.values()))  # greedy: the sampled token ranks first
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])


def test_n_completions_with_a_seed_repeat_and_count_the_prompt_once(api):
    kwargs = dict(model="llm", prompt="Tokens per second", max_tokens=5, n=3, seed=7, temperature=1.0,
                  extra_body={"ignore_eos": True})
    first, again = api.completions.create(**kwargs), api.completions.create(**kwargs)
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert len({c.text for c in first.choices}) > 1  # the completions are sampled apart
    assert first.usage.completion_tokens == 15
    single = api.completions.create(model="llm", prompt="Tokens per second", max_tokens=1)
    assert first.usage.prompt_tokens == single.usage.prompt_tokens


def test_beam_search_through_the_sdk_returns_the_beams_best_first(api, llm, server):
    """vLLM's extra parameters use_beam_search / best_of / n: n choices, best first, the in-process
    engine's beams (token-equal to transformers: tests/test_beam_search.py); the beams count in the
    metrics."""
    from backend import SamplingParams

    ref = llm.generate(["Tokens per second"], SamplingParams(max_tokens=6, temperature=0.0, use_beam_search=True,
                                                              best_of=3, n=2, length_penalty=0.5))[0].samples
    before = gauge(server, "inflight_beam_requests_total")
    out = api.completions.create(model="llm", prompt="Tokens per second", max_tokens=6, n=2,
                                 extra_body={"use_beam_search": True, "best_of": 3, "length_penalty": 0.5})
    assert [c.index for c in out.choices] == [0, 1]
    assert [c.text for c in out.choices] == [s.text for s in ref]
    assert out.usage.completion_tokens == sum(len(s.token_ids) for s in ref)
    assert wait_until(lambda: gauge(server, "inflight_beam_requests_total") >= before + 1)
    # streamed: the beams come once, whole, when the search ends (docs/beam_search.md)
    chunks = list(api.completions.create(model="llm", prompt="Tokens per second", max_tokens=6, n=2, stream=True,
                                         extra_body={"use_beam_search": True, "best_of": 3, "length_penalty": 0.5}))
    texts = {0: "", 1: ""}
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] += choice.text
    assert [texts[0], texts[1]] == [s.text for s in ref]
    assert sum(1 for c in chunks for choice in c.choices if choice.text) <= 2


def test_stop_strings_end_the_text(api, llm):
    ref = llm.greedy("Hello world", 16)
    stop = ref.text[4:7]
    out = api.completions.create(prompt="Hello world", max_tokens=16, stop=[stop], **GREEDY)
    assert out.choices[0].finish_reason == "stop"
    assert stop not in out.choices[0].text and ref.text.startswith(out.choices[0].text)


# -- errors in OpenAI's shape ------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, param", [
    (dict(top_p=3), "top_p"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(presence_penalty=9), "presence_penalty"),
    (dict(extra_body={"max_token": 5}), "max_token"),
])
def test_bad_parameters_get_openai_errors(api, kwargs, param):
    with pytest.raises(openai.BadRequestError) as err:
        api.completions.create(model="llm", prompt="Hi", **kwargs)
    assert err.value.status_code == 400
    assert err.value.body["param"] == param and param in err.value.body["message"]
    assert err.value.body["type"] == "invalid_request_error"


def test_refusals_from_the_model_and_unknown_models(api):
    with pytest.raises(openai.BadRequestError, match="max_model_len"):  # the engine's own check
        api.completions.create(model="llm", prompt="hello " * (MAX_MODEL_LEN + 8), max_tokens=4)
    # token ids: past the vocabulary, the engine's 400; past INT32, the server's (never wrapped)
    with pytest.raises(openai.BadRequestError, match=r"token id 99999 is outside the vocabulary \[0, 2000\)"):
        api.completions.create(model="llm", prompt=[1, 99999], max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="token id 4294967301 is outside the vocabulary"):
        api.completions.create(model="llm", prompt=[1, 4294967301], max_tokens=2)
    with pytest.raises(openai.NotFoundError) as err:
        api.completions.create(model="gpt-4o", prompt="Hi")
    assert err.value.body["code"] == "model_not_found" and err.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError, match="no chat template") as err:  # the tiny model has none
        api.chat.completions.create(model="llm", messages=[{"role": "user", "content": "Hi"}])
    assert err.value.body["param"] == "messages"


def test_triton_unreachable_is_a_503():
    with OpenAIServer(f"127.0.0.1:{free_port()}") as api_server:  # nothing listens there
        with pytest.raises(openai.APIStatusError) as err:
            sdk(api_server).completions.create(model="llm", prompt="Hi", max_tokens=2)
    assert err.value.status_code == 503 and "unreachable" in err.value.body["message"]


# -- a client that leaves ----------------------------------------------------------------------------

def test_a_disconnected_streaming_client_frees_its_kv_blocks(api, server):
    before = gauge(server, "inflight_generation_tokens_total")
    stream = api.completions.create(model="llm", prompt="Cancel me part-way", max_tokens=400, stream=True,
                                    extra_body={"ignore_eos": True})
    received = 0
    for chunk in stream:
        received += 1
        if received == 3:
            assert gauge(server, "inflight_kv_blocks", state="used") > 0
            assert gauge(server, "inflight_num_requests_running") == 1
            break
    stream.close()  # the HTTP connection goes; the server must cancel the Triton request
    wait_until(lambda: gauge(server, "inflight_kv_blocks", state="used") == 0, timeout=10)
    assert gauge(server, "inflight_num_requests_running") == 0
    assert gauge(server, "inflight_generation_tokens_total") - before < 400
    assert api.completions.create(model="llm", prompt="still serving", max_tokens=2,
                                  extra_body={"ignore_eos": True}).choices[0].finish_reason == "length"


# -- chat on SmolLM2-135M-Instruct -------------------------------------------------------------------

@pytest.fixture(scope="module")
def smollm2_api(model_repository):
    from serving.triton_launcher import TritonServer
    from smollm2 import smollm2_dir

    path = smollm2_dir()  # fetched and imported as `make model` does (once; reused afterwards)
    # One request runs and one may wait: a third is refused (the queue-full test).
    params = {"max_model_len": "1024", "max_num_seqs": "1", "max_queue_size": "1"}
    with TritonServer(model_repository, params=params, model_path=str(path)) as triton:
        with OpenAIServer(triton.grpc_url, path) as api_server:
            yield sdk(api_server), path, triton


QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def test_smollm2_chat_answers_paris_and_the_stream_joins_to_it(smollm2_api):
    from backend.text.tokenizer import Tokenizer

    api, path, _ = smollm2_api
    whole = api.chat.completions.create(messages=QUESTION, max_tokens=16, **GREEDY)
    answer = whole.choices[0].message.content
    assert "Paris" in answer, answer
    assert whole.choices[0].message.role == "assistant"
    tokenizer = Tokenizer.from_dir(path)
    prompt_ids = tokenizer.encode(tokenizer.render_chat(QUESTION), add_special_tokens=False)
    assert whole.usage.prompt_tokens == len(prompt_ids)

    chunks = list(api.chat.completions.create(messages=QUESTION, max_tokens=16, stream=True,
                                              stream_options={"include_usage": True}, **GREEDY))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant"
    assert "".join(d.content or "" for d in deltas) == answer
    assert counts(chunks[-1].usage) == counts(whole.usage)
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 16 * ((len(prompt_ids) - 1) // 16) > 0

    lp = api.chat.completions.create(messages=QUESTION, max_tokens=4, logprobs=True, top_logprobs=2, **GREEDY)
    content = lp.choices[0].logprobs.content
    assert len(content) == lp.usage.completion_tokens == 4
    assert "".join(t.token for t in content) == lp.choices[0].message.content
    assert all(len(t.top_logprobs) == 2 and t.logprob == pytest.approx(t.top_logprobs[0].logprob) for t in content)



def test_a_full_queue_is_a_429(smollm2_api):
    import threading

    api, _, triton = smollm2_api
    long = dict(model="llm", messages=QUESTION, max_tokens=300, stream=True, extra_body={"ignore_eos": True})
    running = api.chat.completions.create(**long)
    next(iter(running))  # it runs: max_num_seqs is 1
    waiting = threading.Thread(target=lambda: list(api.chat.completions.create(**{**long, "max_tokens": 2})))
    waiting.start()  # it waits: the queue (max_queue_size 1) is full now
    try:
        wait_until(lambda: gauge(triton, "inflight_num_requests_waiting") == 1, timeout=30)
        with pytest.raises(openai.RateLimitError) as err:
            api.chat.completions.create(model="llm", messages=QUESTION, max_tokens=2)
        assert err.value.status_code == 429 and "queue full" in err.value.body["message"]
        assert err.value.body["type"] == "rate_limit_error"
    finally:
        running.close()  # cancels it; the waiting one then runs its 2 tokens
        waiting.join(60)
    assert not waiting.is_alive()


def test_a_queued_stream_whose_client_leaves_is_cancelled_before_it_runs(smollm2_api):
    """A stream's headers wait for its first token; a client that goes while the request still waits
    for a slot must cancel it then, not when a slot frees and its first token comes."""
    import json
    import socket

    api, _, triton = smollm2_api
    running = api.chat.completions.create(model="llm", messages=QUESTION, max_tokens=300, stream=True,
                                          extra_body={"ignore_eos": True})
    next(iter(running))  # it runs: max_num_seqs is 1
    try:
        body = json.dumps({"model": "llm", "messages": QUESTION, "max_tokens": 5, "stream": True}).encode()
        with socket.create_connection((api.base_url.host, api.base_url.port), timeout=30) as sock:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n"
                         b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
            wait_until(lambda: gauge(triton, "inflight_num_requests_waiting") == 1, timeout=30)
        # the socket is closed: the queued request goes while the first one still runs
        wait_until(lambda: gauge(triton, "inflight_num_requests_waiting") == 0, timeout=10)
        assert gauge(triton, "inflight_num_requests_running") == 1
    finally:
        running.close()


# `inflight serve` starting it beside tritonserver and stopping it with it: tests/e2e/test_cli.py
