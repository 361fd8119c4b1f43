"""The engine's sampling and stop semantics against vLLM's: EOS handling on a model that does end
(make-model --eos-boost), min_tokens, stop strings on the last token, near-zero temperature and
top_p, the KV fit of the last token, logprobs against transformers, penalties against vLLM's
formulas, n > 1 completions and bad_words."""
import numpy as np
import pytest
import torch

from backend import LLM, SamplingParams
from backend.models.make_model import make_model
from seq_states import seq_state
from backend.worker.sampler import _apply_penalties, sample

PROMPTS = [[1, 5 + i, 6, 9 + 2 * i] for i in range(12)]


@pytest.fixture(scope="module")
def llm(default_model_dir):
    return LLM(str(default_model_dir), max_num_seqs=16)


@pytest.fixture(scope="module")
def ending_llm(tmp_path_factory):
    """A model whose EOS logit is boosted, so it samples EOS often (the default one almost never)."""
    return LLM(str(make_model(tmp_path_factory.mktemp("eos-model"), eos_boost=8.0)), max_num_seqs=16)


def test_ignore_eos_runs_to_max_tokens_on_a_model_that_ends(ending_llm):
    params = SamplingParams(max_tokens=24, temperature=1.0, seed=3)
    ended = ending_llm.generate(PROMPTS, params)
    assert sum(o.finish_reason == "stop" and len(o.token_ids) < 24 for o in ended) >= len(PROMPTS) // 2
    eos = ending_llm.engine.model_config.eos_token_ids
    assert all(o.token_ids[-1] in eos for o in ended if o.finish_reason == "stop")
    forced = ending_llm.generate(PROMPTS, SamplingParams(max_tokens=24, temperature=1.0, seed=3, ignore_eos=True))
    assert all(len(o.token_ids) == 24 and o.finish_reason == "length" for o in forced)
    assert any(t in eos for o in forced for t in o.token_ids), "EOS is generated, just not stopped on"


def test_min_tokens_masks_eos_until_reached(ending_llm):
    eos = set(ending_llm.engine.model_config.eos_token_ids)
    outs = ending_llm.generate(PROMPTS, SamplingParams(max_tokens=24, temperature=1.0, seed=5, min_tokens=10))
    for o in outs:
        assert len(o.token_ids) >= 10
        assert not eos & set(o.token_ids[:10]), "EOS sampled before min_tokens"
    assert any(o.finish_reason == "stop" for o in outs)


def test_min_tokens_holds_back_stop_strings(llm):
    greedy = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=12, temperature=0))[0]
    stop = greedy.text[:3]
    assert stop.strip(), "the greedy text starts with something to stop on"
    early = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=12, temperature=0, stop=[stop]))[0]
    assert early.finish_reason == "stop" and len(early.token_ids) < 12
    held = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=12, temperature=0, stop=[stop], min_tokens=8))[0]
    assert len(held.token_ids) > 8 and held.text.startswith(greedy.text[:3])


def test_a_stop_string_on_the_last_allowed_token_reports_stop(llm):
    greedy = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=10, temperature=0))[0]
    tail = greedy.text[-2:]
    assert tail and greedy.text.find(tail) == len(greedy.text) - 2, "the stop string occurs only at the end"
    out = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=10, temperature=0, stop=[tail]))[0]
    assert out.token_ids == greedy.token_ids
    assert out.finish_reason == "stop" and out.text == greedy.text[:-2]


def test_near_zero_temperature_and_top_p_are_greedy(llm):
    greedy = llm.generate(PROMPTS[:4], SamplingParams(max_tokens=10, temperature=0))
    cold = llm.generate(PROMPTS[:4], SamplingParams(max_tokens=10, temperature=1e-40, seed=1))
    narrow = llm.generate(PROMPTS[:4], SamplingParams(max_tokens=10, temperature=1.0, top_p=1e-300, seed=1))
    assert [o.token_ids for o in cold] == [o.token_ids for o in greedy]
    assert [o.token_ids for o in narrow] == [o.token_ids for o in greedy]


def test_the_last_sampled_token_needs_no_kv_slot(default_model_dir):
    small = LLM(str(default_model_dir), max_tokens_in_paged_kv_cache=32, kv_block_size=16)
    prompt = list(range(3, 23))  # 20 tokens + 13 new = 33 tokens, of which 32 are ever stored
    out = small.generate([prompt], SamplingParams(max_tokens=13, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 13
    with pytest.raises(ValueError, match="exceeds the KV cache"):
        small.generate([prompt], SamplingParams(max_tokens=14, temperature=0))
    assert small.stats()["kv_blocks_used"] == 0


def test_logprobs_equal_transformers_log_softmax(default_model_dir, llm):
    from transformers import AutoModelForCausalLM
    out = llm.generate([PROMPTS[2]], SamplingParams(max_tokens=8, temperature=0, logprobs=5))[0]
    hf = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([PROMPTS[2] + out.token_ids])
    with torch.no_grad():
        ref = torch.log_softmax(hf(ids).logits[0].float(), dim=-1)[len(PROMPTS[2]) - 1:-1]
    assert len(out.logprobs) == 8
    total = 0.0
    for step, (token, entries) in enumerate(zip(out.token_ids, out.logprobs)):
        row = ref[step]
        top = row.topk(5)
        assert set(entries) == set(top.indices.tolist()) | {token}
        for tok, lp in entries.items():
            assert abs(lp.logprob - float(row[tok])) < 1e-4
            assert lp.rank == int((row > row[tok]).sum()) + 1
        assert entries[token].rank == 1  # greedy
        total += entries[token].logprob
    assert out.cumulative_logprob == pytest.approx(total, abs=1e-4)
    plain = llm.generate([PROMPTS[2]], SamplingParams(max_tokens=8, temperature=0))[0]
    assert plain.token_ids == out.token_ids and plain.logprobs is None


@pytest.mark.parametrize("rep, pres, freq", [(1.3, 0.0, 0.0), (0.7, 0.0, 0.0), (1.0, 0.5, 0.0),
                                             (1.0, 0.0, 0.4), (1.2, -0.3, 0.6)])
def test_penalties_follow_vllms_formulas(rep, pres, freq):
    rng = np.random.default_rng(7)
    vocab = 40
    logits = rng.normal(0, 2, vocab).astype(np.float32)
    prompt, output = [3, 5, 5, 9], [5, 11, 11, 11, 2]
    params = SamplingParams(max_tokens=20, temperature=0, repetition_penalty=rep, presence_penalty=pres,
                            frequency_penalty=freq)
    req = seq_state("p", prompt, params)
    req.output_token_ids = list(output)
    got = torch.from_numpy(logits.copy())
    _apply_penalties(got, req)
    want = logits.astype(np.float64).copy()
    for t in set(prompt) | set(output):  # vLLM: divide positive logits, multiply negative ones
        want[t] = want[t] / rep if want[t] > 0 else want[t] * rep
    counts = np.bincount(output, minlength=vocab)
    want -= freq * counts + pres * (counts > 0)
    assert np.allclose(got.numpy(), want, atol=1e-5)
    assert sample(torch.from_numpy(logits.copy())[None], [req])[0].token == int(np.argmax(want))


def test_n_completions_share_the_prompt_and_differ_when_sampled(llm):
    prompt = list(range(3, 40))  # 37 tokens: two full blocks of 16 to share
    greedy = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0))[0]
    three = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0, n=3))[0]
    assert [s.index for s in three.samples] == [0, 1, 2]
    assert all(s.token_ids == greedy.token_ids for s in three.samples)
    sampled = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=1.0, seed=9, n=4))[0]
    assert len({tuple(s.token_ids) for s in sampled.samples}) > 1
    again = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=1.0, seed=9, n=4))[0]
    assert [s.token_ids for s in again.samples] == [s.token_ids for s in sampled.samples]
    assert llm.stats()["kv_blocks_used"] == 0


def test_n_completions_compute_the_prompt_once(default_model_dir):
    eng = LLM(str(default_model_dir)).engine
    eng.add_request("fam", list(range(3, 40)), SamplingParams(max_tokens=4, temperature=0, n=3))
    computed = 0
    while eng.has_work():
        batch = eng.scheduler.schedule(0.0)
        computed += batch.num_batched_tokens
        sampled = eng.runner.execute(eng.scheduler.plan(batch)).sampled
        eng.scheduler.postprocess(batch, sampled, 0.0)
        eng.scheduler.check_integrity()
    # 37 prompt tokens once, then each of the two others recomputes only its last partial block
    # (37 - 32 = 5 tokens), and 3 x 3 decode steps
    assert computed == 37 + 2 * 5 + 3 * 3


def test_bad_words_are_never_generated(llm):
    greedy = llm.generate([PROMPTS[3]], SamplingParams(max_tokens=12, temperature=0))[0]
    tok = llm.tokenizer
    word = tok.decode([greedy.token_ids[2]]).strip()
    assert word
    banned = llm.engine._bad_words_ids([word])
    out = llm.generate([PROMPTS[3]], SamplingParams(max_tokens=12, temperature=0, bad_words=[word]))[0]
    assert out.token_ids[:2] == greedy.token_ids[:2]
    for ids in banned:
        n = len(ids)
        assert all(out.token_ids[i:i + n] != ids for i in range(len(out.token_ids))), f"{word!r} generated"


def test_a_stop_token_ends_the_output_but_is_left_out_of_its_text(llm):
    """vLLM v1: a token of stop_token_ids is the last of token_ids, and not in the text."""
    greedy = llm.generate([PROMPTS[4]], SamplingParams(max_tokens=12, temperature=0))[0]
    tok = llm.tokenizer
    at = next(i for i in range(3, 12) if tok.decode([greedy.token_ids[i]]).strip()
              and greedy.token_ids[i] not in greedy.token_ids[:i])
    stop_id = greedy.token_ids[at]
    for stream in (False, True):
        if stream:  # the same through the step outputs (what the server streams)
            eng = llm.engine
            eng.add_request("stop-token", PROMPTS[4], SamplingParams(max_tokens=12, temperature=0,
                                                                      stop_token_ids=[stop_id]))
            steps = []
            while eng.has_work():
                steps += eng.step()
            out = steps[-1]
            assert "".join(o.new_text for o in steps) == out.text
        else:
            out = llm.generate([PROMPTS[4]], SamplingParams(max_tokens=12, temperature=0,
                                                            stop_token_ids=[stop_id]))[0]
        assert out.finish_reason == "stop" and out.token_ids == greedy.token_ids[:at + 1]
        assert out.text == tok.decode(greedy.token_ids[:at])
        assert not out.text.endswith(tok.decode([stop_id]))


def test_bad_words_ban_the_word_after_a_space_too(llm):
    """vLLM bans each bad word alone and after a space. The oracle is the tokenizer, not the
    engine's own list: find a greedy output with a word that a space makes a different token of the
    same length (" two" vs "two"), ban the bare word, and that token must vanish from the output."""
    tok = llm.tokenizer
    greedy = llm.generate(PROMPTS, SamplingParams(max_tokens=16, temperature=0))
    found = None
    for prompt, out in zip(PROMPTS, greedy):
        for i, t in enumerate(out.token_ids):
            piece = tok.decode([t])
            word = piece.strip()
            if not (piece.startswith(" ") and word.isalpha()):
                continue
            plain = tok.encode(word, add_special_tokens=False)
            spaced = tok.encode(" " + word, add_special_tokens=False)
            if spaced == [t] and len(plain) == len(spaced) and plain != spaced:
                found = (prompt, out, i, word, plain, spaced)
                break
        if found:
            break
    assert found, "no greedy output holds a spaced word to ban"
    prompt, out, at, word, plain, spaced = found
    banned = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0, bad_words=[word]))[0]
    assert banned.token_ids[:at] == out.token_ids[:at]
    assert banned.token_ids[at] != spaced[0]
    for ids in (plain, spaced):
        assert all(banned.token_ids[i:i + len(ids)] != ids for i in range(len(banned.token_ids))), (word, ids)


def test_stop_strings_are_looked_for_only_past_min_tokens(llm):
    """vLLM: a stop string counts once more than min_tokens tokens exist. One that completes on
    token k (1-based) stops the output with min_tokens k - 1, and not with min_tokens k."""
    tok = llm.tokenizer
    greedy = llm.generate([PROMPTS[2]], SamplingParams(max_tokens=16, temperature=0))[0]
    pieces = [tok.decode([t]) for t in greedy.token_ids]
    k = next(i + 1 for i in range(2, 16) if len(pieces[i].strip()) >= 3
             and greedy.text.find(pieces[i]) == len(tok.decode(greedy.token_ids[:i])))
    stop = pieces[k - 1]  # first completes with the k-th token
    base = dict(max_tokens=16, temperature=0, stop=[stop])
    stopped = llm.generate([PROMPTS[2]], SamplingParams(min_tokens=k - 1, **base))[0]
    assert stopped.finish_reason == "stop" and len(stopped.token_ids) == k
    assert stopped.text == tok.decode(greedy.token_ids[:k - 1])
    held = llm.generate([PROMPTS[2]], SamplingParams(min_tokens=k, **base))[0]
    assert len(held.token_ids) > k and held.token_ids[:k] == greedy.token_ids[:k]
    assert held.text.startswith(tok.decode(greedy.token_ids[:k]))


def test_logprobs_are_of_the_raw_logits_before_penalties_and_bans():
    """vLLM v1's logprobs are log_softmax of the raw logits: penalties, bad words and the
    min_tokens ban of EOS change which token is sampled, never the logprobs reported."""
    rng = np.random.default_rng(3)
    logits = rng.normal(0, 2, 40).astype(np.float32)
    order = np.argsort(-logits)
    eos, bad, seen = int(order[0]), int(order[1]), int(order[2])
    params = SamplingParams(max_tokens=10, temperature=0, repetition_penalty=1.8, presence_penalty=1.5,
                            min_tokens=5, logprobs=5)
    req = seq_state("p", [seen, 3], params, eos_token_ids=(eos,))
    req.output_token_ids = [seen, 7]
    req.bad_words_ids = [[bad]]
    got = sample(torch.from_numpy(logits.copy())[None], [req])[0]
    assert got.token not in (eos, bad, seen), "the bans and penalties moved the choice"
    raw = torch.log_softmax(torch.from_numpy(logits).double(), -1)
    assert got.logprob == pytest.approx(float(raw[got.token]), abs=1e-5)
    assert got.rank == int((raw > raw[got.token]).sum()) + 1 > 3
    assert [t for t, _ in got.top] == order[:5].tolist()
    assert [lp for _, lp in got.top] == pytest.approx(raw[order[:5]].tolist(), abs=1e-5)
