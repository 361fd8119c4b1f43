"""Completions' `echo` with `logprobs` through a real tritonserver and the official `openai` SDK, as
vLLM answers it (issue 43 item 3's leftover): the prompt's tokens lead the choice's logprobs, the
first with null logprob and top logprobs, the others the engine's prompt logprobs, then the
generated tokens' own; streamed and not, against the in-process engine."""
import pytest

from backend import SamplingParams
from serving.openai_launcher import OpenAIServer

from .conftest import requires_tritonserver

pytestmark = requires_tritonserver
openai = pytest.importorskip("openai")
PROMPT = "The quick brown fox jumps over the lazy dog and then"


@pytest.fixture(scope="module")
def api(server, model_path):
    with OpenAIServer(server.grpc_url, model_path) as api_server:
        yield openai.OpenAI(base_url=f"{api_server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_echo_with_logprobs_leads_with_the_prompts_tokens(api, llm):
    ref = llm.generate([PROMPT], SamplingParams(max_tokens=5, temperature=0, logprobs=2, prompt_logprobs=2))[0]
    ids, n = ref.prompt_token_ids, len(ref.prompt_token_ids)
    body = api.completions.create(model="llm", prompt=PROMPT, max_tokens=5, temperature=0, logprobs=2, echo=True)
    choice = body.choices[0]
    assert choice.text == PROMPT + ref.text
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n + 5
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    want = [ref.prompt_logprobs[i][ids[i]].logprob for i in range(1, n)] + \
        [step[t].logprob for step, t in zip(ref.logprobs, ref.token_ids)]
    assert lp.token_logprobs[1:] == pytest.approx(want, abs=1e-5)
    assert lp.tokens[1] == ref.prompt_logprobs[1][ids[1]].decoded_token
    assert all(len(top) <= 2 for top in lp.top_logprobs[1:])
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    streamed = list(api.completions.create(model="llm", prompt=PROMPT, max_tokens=5, temperature=0, logprobs=2,
                                           echo=True, stream=True))
    tokens = [t for chunk in streamed for t in (chunk.choices[0].logprobs.tokens if chunk.choices[0].logprobs else [])]
    values = [v for chunk in streamed for v in (chunk.choices[0].logprobs.token_logprobs
                                                 if chunk.choices[0].logprobs else [])]
    offsets = [v for chunk in streamed for v in (chunk.choices[0].logprobs.text_offset
                                                  if chunk.choices[0].logprobs else [])]
    assert tokens == lp.tokens and values[0] is None and values[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-5)
    assert offsets == lp.text_offset
    assert "".join(chunk.choices[0].text for chunk in streamed) == choice.text
