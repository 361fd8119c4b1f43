"""include_stop_str_in_output, skip_special_tokens, spaces_between_special_tokens and
truncate_prompt_tokens (vLLM's SamplingParams) on the engine, against the tokenizer's own decode
and the greedy output of the truncated prompt; streamed deltas add up to the final text; composed
with allowed_token_ids and logit_bias, which put special tokens into the output."""
import pytest
from tokenizers import Tokenizer as HFTokenizer, models, pre_tokenizers

from backend import LLM, SamplingParams
from backend.text.detokenizer import IncrementalDetokenizer
from backend.text.tokenizer import Tokenizer

PROMPT = [1, 7, 8, 12, 30, 41, 5]


@pytest.fixture(scope="module")
def llm(default_model_dir):
    return LLM(str(default_model_dir), max_num_seqs=8, max_model_len=96)


def _streamed(llm, prompt, params):
    """The step outputs' new texts joined, and the last output (what the server streams)."""
    eng = llm.engine
    eng.add_request("streamed", prompt, params)
    steps = []
    while eng.has_work():
        steps += eng.step()
    return "".join(o.new_text for o in steps), steps[-1]


def test_include_stop_str_in_output_keeps_the_stop_string_streamed_or_not(llm):
    full = llm.generate([PROMPT], SamplingParams(max_tokens=24, temperature=0))[0].text
    stop = full[9:12]
    at = full.index(stop)
    assert stop.strip() and at > 0
    for include in (False, True):
        params = SamplingParams(max_tokens=24, temperature=0, stop=[stop], include_stop_str_in_output=include)
        out = llm.generate([PROMPT], params)[0]
        want = full[:at + len(stop)] if include else full[:at]
        assert out.finish_reason == "stop" and out.text == want
        text, last = _streamed(llm, PROMPT, params)
        assert text == last.text == want


def test_include_stop_str_in_output_keeps_a_stop_tokens_text(llm):
    greedy = llm.generate([PROMPT], SamplingParams(max_tokens=12, temperature=0))[0]
    tok = llm.tokenizer
    at = next(i for i in range(3, 12) if tok.decode([greedy.token_ids[i]]).strip()
              and greedy.token_ids[i] not in greedy.token_ids[:i])
    params = SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[greedy.token_ids[at]],
                            include_stop_str_in_output=True)
    out = llm.generate([PROMPT], params)[0]
    assert out.token_ids == greedy.token_ids[:at + 1] and out.text == tok.decode(greedy.token_ids[:at + 1])


@pytest.mark.parametrize("skip", [True, False])
def test_skip_special_tokens_against_the_tokenizers_decode(llm, skip):
    """allowed_token_ids with the special <s> and </s> (and ignore_eos), a bias toward <s>: the
    output holds special tokens; its text is the tokenizer's decode with the same switch."""
    tok = llm.tokenizer
    specials = sorted(tok.all_special_ids)
    words = tok.encode(" the cat sat on a mat", add_special_tokens=False)
    params = SamplingParams(max_tokens=20, seed=4, ignore_eos=True, allowed_token_ids=specials + words,
                            logit_bias={specials[1]: 3.0}, skip_special_tokens=skip)
    out = llm.generate([PROMPT], params)[0]
    assert set(out.token_ids) <= set(specials + words)
    assert set(out.token_ids) & set(specials) and set(out.token_ids) - set(specials)
    assert out.text == tok.decode(out.token_ids, skip_special_tokens=skip)
    text, last = _streamed(llm, PROMPT, params)
    assert text == last.text == out.text


def _word_level() -> Tokenizer:
    """A tokenizer without a decoder: decode joins its tokens with spaces (as a slow tokenizer's
    convert_tokens_to_string would), which is where spaces_between_special_tokens shows."""
    vocab = {"<s>": 0, "</s>": 1, "a": 2, "b": 3, "c": 4, "[UNK]": 5}
    hf = HFTokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    return Tokenizer(hf, {"bos_token": "<s>", "eos_token": "</s>"})


@pytest.mark.parametrize("spaces,want", [(True, "a <s> </s> b c <s>"), (False, "a<s></s>b c<s>")])
def test_spaces_between_special_tokens(spaces, want):
    tok = _word_level()
    ids = [2, 0, 1, 3, 4, 0]
    if spaces:
        assert tok.decode(ids, skip_special_tokens=False) == want  # the tokenizer's own decode
    detok = IncrementalDetokenizer(tok, [0], skip_special_tokens=False, spaces_between_special_tokens=spaces)
    streamed = "".join(detok.add([t]) for t in ids) + detok.flush()
    assert streamed.lstrip() == want
    skipped = IncrementalDetokenizer(tok, [0], skip_special_tokens=True, spaces_between_special_tokens=spaces)
    assert ("".join(skipped.add([t]) for t in ids) + skipped.flush()).strip() == "a b c"


def test_truncate_prompt_tokens_keeps_the_last_tokens(llm):
    long = [1] + [5 + (7 * i) % 50 for i in range(40)]
    last = llm.generate([long[-9:]], SamplingParams(max_tokens=10, temperature=0))[0]
    out = llm.generate([long], SamplingParams(max_tokens=10, temperature=0, truncate_prompt_tokens=9))[0]
    assert out.prompt_token_ids == long[-9:] and out.token_ids == last.token_ids
    text = "one two three four five six seven eight nine ten eleven twelve"
    ids = llm.tokenizer.encode(text)
    out = llm.generate([text], SamplingParams(max_tokens=4, temperature=0, truncate_prompt_tokens=5))[0]
    assert out.prompt_token_ids == ids[-5:]
    too_long = [1] + [5 + i % 50 for i in range(120)]  # past max_model_len (96): -1 keeps its last 96
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([too_long], SamplingParams(max_tokens=2, temperature=0))
    with pytest.raises(ValueError, match="max_model_len"):  # 96 prompt tokens leave no room for output
        llm.generate([too_long], SamplingParams(max_tokens=2, temperature=0, truncate_prompt_tokens=-1))
    out = llm.generate([too_long], SamplingParams(max_tokens=2, temperature=0, truncate_prompt_tokens=90))[0]
    assert out.prompt_token_ids == too_long[-90:]


def test_include_stop_str_in_output_holds_nothing_back_while_streaming(llm):
    """With a stop string that never comes, a plain stream lags the text by up to its length - 1
    characters (a stop string split over steps is never partly sent); with
    include_stop_str_in_output nothing is held: every step's text is all there is so far (vLLM)."""
    stop = ["<never here at all>"]
    lags = {}
    for include in (False, True):
        eng = llm.engine
        eng.add_request(f"lag-{include}", PROMPT, SamplingParams(max_tokens=12, temperature=0, stop=stop,
                                                                  include_stop_str_in_output=include))
        sent, lag = "", 0
        while eng.has_work():
            for o in eng.step():
                sent += o.new_text
                if not o.finished:
                    lag = max(lag, len(llm.tokenizer.decode(o.token_ids)) - len(sent))
        lags[include] = lag
    assert lags[True] == 0 < lags[False] <= len(stop[0]) - 1
