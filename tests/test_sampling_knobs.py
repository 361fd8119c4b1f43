"""min_p, logit_bias and allowed_token_ids (vLLM's SamplingParams), through the batched sampler,
against a numpy sampler written from vLLM's definitions (client/tools/gpu_check/sampling.py, which
gpu-check runs on the GPU): the same fixed logits, the same seeded uniform number, the same token;
composed with each other, with temperature / top-k / top-p, with penalties and with a grammar's
mask."""
import random

import numpy as np
import pytest
import torch

from backend.core.sampling_params import SamplingParams
from backend.worker.sampler import sample
from client.tools.gpu_check.sampling import KNOB_CASES, OUTPUT, _near_tie, reference_token as _reference, sampler_check
from seq_states import seq_state

VOCAB = 64


KNOBS = KNOB_CASES


@pytest.mark.parametrize("knobs", KNOBS, ids=[",".join(k) for k in KNOBS])
def test_each_knob_and_their_compositions_match_the_numpy_sampler(knobs):
    """200 rows of fixed random logits, each its own seed: every token equals the reference's,
    drawn with the same uniform number (the first of the sequence's seeded stream)."""
    rng = np.random.default_rng(7)
    logits = rng.normal(0, 2.0, (200, VOCAB)).astype(np.float32)
    output = OUTPUT
    rows, want = [], []
    for i in range(len(logits)):
        p = SamplingParams(max_tokens=8, seed=1000 + i, **knobs)
        rows.append(seq_state(f"r{i}", [1, 2, 3], p, output=output))
        want.append(_reference(logits[i], p, random.Random(1000 + i).random(), output))
    got = [s.token for s in sample(torch.from_numpy(logits.copy()), rows)]
    assert got == want
    if "allowed_token_ids" in knobs:
        assert set(got) <= set(knobs["allowed_token_ids"])
    if knobs.get("temperature", 1.0) > 0:
        assert len(set(got)) > 1, "the draws vary: a fixed point would hide a wrong filter"


def test_min_p_filters_what_plain_sampling_would_draw():
    """The knob bites: without min_p some of these draws fall below 0.3 x p_max; with it none does."""
    rng = np.random.default_rng(3)
    logits = rng.normal(0, 1.0, (400, VOCAB)).astype(np.float32)

    def draws(min_p):
        rows = [seq_state(f"r{i}", [1], SamplingParams(max_tokens=4, seed=i, min_p=min_p)) for i in range(400)]
        return [s.token for s in sample(torch.from_numpy(logits.copy()), rows)]

    probs = np.exp(logits - logits.max(1, keepdims=True))
    probs /= probs.sum(1, keepdims=True)
    low = [probs[i, t] < 0.3 * probs[i].max() for i, t in enumerate(draws(0.0))]
    assert any(low)
    assert not any(probs[i, t] < 0.3 * probs[i].max() for i, t in enumerate(draws(0.3)))


def test_knobs_compose_with_a_grammar_mask_and_leave_logprobs_raw():
    """A grammar's mask, allowed tokens and a bias on one row: the token is the reference's with the
    mask; its logprob is the raw logits' log_softmax (vLLM v1: before every processor)."""
    from backend.worker.sampler import prepare  # noqa: F401  (the path sample() takes)
    rng = np.random.default_rng(11)
    logits = rng.normal(0, 2.0, (2, VOCAB)).astype(np.float32)
    mask = np.zeros(VOCAB, dtype=bool)
    mask[[3, 4, 5, 20, 21]] = True
    words = np.zeros((1, 2), dtype=np.uint32)  # xgrammar's layout: bit t % 32 of word t // 32 allows t
    for t in np.flatnonzero(mask):
        words[0, t // 32] |= np.uint32(1 << (t % 32))
    bitmask = words.view(np.int32)
    params = [SamplingParams(max_tokens=4, seed=5, allowed_token_ids=[4, 5, 20, 60], logit_bias={20: -3.0},
                             logprobs=2),
              SamplingParams(max_tokens=4, temperature=0.0, allowed_token_ids=[4, 5, 20, 60], logit_bias={20: 9.0})]
    rows = [seq_state(f"g{i}", [1], p) for i, p in enumerate(params)]
    got = sample(torch.from_numpy(logits.copy()), rows, ([0, 1], np.repeat(bitmask, 2, axis=0)))
    for i, p in enumerate(params):
        assert got[i].token == _reference(logits[i], p, random.Random(5).random(), mask=mask)
        assert got[i].token in (4, 5, 20)  # allowed and by the grammar: 60 never
    raw = torch.log_softmax(torch.from_numpy(logits[0]).double(), -1)
    assert got[0].logprob == pytest.approx(float(raw[got[0].token]), abs=1e-5)


def test_greedy_rows_without_the_knobs_keep_the_fast_path_and_biased_ones_leave_it():
    logits = torch.zeros(2, VOCAB)
    logits[:, 7] = 1.0
    plain = SamplingParams(max_tokens=4, temperature=0.0)
    biased = SamplingParams(max_tokens=4, temperature=0.0, logit_bias={9: 1.5})
    assert [s.token for s in sample(logits.clone(), [seq_state("a", [1], plain), seq_state("b", [1], biased)])] == [7, 9]
    only = SamplingParams(max_tokens=4, temperature=0.0, allowed_token_ids=[30, 31])
    logits[:, 31] = 0.5
    assert sample(logits.clone(), [seq_state("c", [1], only)])[0].token == 31


@pytest.mark.parametrize("bad,field", [
    (dict(min_p=1.5), "min_p"), (dict(min_p=-0.1), "min_p"), (dict(logit_bias={3: 101}), "logit_bias"),
    (dict(logit_bias={-1: 1.0}), "logit_bias"), (dict(allowed_token_ids=[]), "allowed_token_ids"),
    (dict(allowed_token_ids=[-2]), "allowed_token_ids"), (dict(prompt_logprobs=21), "prompt_logprobs"),
    (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens"), (dict(skip_special_tokens="yes"), "skip_special_tokens")])
def test_out_of_range_values_are_refused_naming_the_field(bad, field):
    with pytest.raises(ValueError, match=f"^{field}"):
        SamplingParams(max_tokens=4, **bad)


def test_from_dict_takes_the_json_forms_and_the_vocabulary_check_names_the_field():
    p = SamplingParams.from_dict({"min_p": "0.25", "logit_bias": {"17": -5, "3": "2.5"}, "allowed_token_ids": [1, "2"],
                                  "prompt_logprobs": 3, "include_stop_str_in_output": "true",
                                  "skip_special_tokens": False, "spaces_between_special_tokens": "0",
                                  "truncate_prompt_tokens": 12})
    assert (p.min_p, p.logit_bias, p.allowed_token_ids, p.prompt_logprobs) == (0.25, {17: -5.0, 3: 2.5}, [1, 2], 3)
    assert (p.include_stop_str_in_output, p.skip_special_tokens, p.spaces_between_special_tokens) == (True, False, False)
    assert p.truncate_prompt_tokens == 12
    with pytest.raises(ValueError, match="logit_bias: token id 64 is outside"):
        SamplingParams(max_tokens=4, logit_bias={64: 1.0}).check_token_ids(VOCAB)
    with pytest.raises(ValueError, match="allowed_token_ids: token id 99 is outside"):
        SamplingParams(max_tokens=4, allowed_token_ids=[1, 99]).check_token_ids(VOCAB)
    with pytest.raises(ValueError, match="sampling parameter 'logit_bias': bad value"):
        SamplingParams.from_dict({"logit_bias": [1, 2]})


@pytest.mark.slow
def test_gpu_checks_sampler_check_passes_here_and_excuses_only_boundary_draws():
    """What gpu-check runs on the device, on the CPU: every token exact; and its rounding excuse
    does not cover a real difference (a token far from the one drawn)."""
    res = sampler_check("cpu")
    assert res["ok"] and res["exact"] == len(KNOB_CASES) * 200 and res["rounding"] == 0
    rng = np.random.default_rng(7)
    row = rng.normal(0, 2.0, VOCAB).astype(np.float32)
    p = SamplingParams(max_tokens=4, seed=1, min_p=0.1)
    u = random.Random(1).random()
    want = _reference(row, p, u, OUTPUT)
    far = next(t for t in range(VOCAB) if abs(t - want) > 3)
    assert not _near_tie(row, p, u, far, want)
    greedy = SamplingParams(max_tokens=4, temperature=0.0)
    top = _reference(row, greedy, 0.0, OUTPUT)
    assert not _near_tie(row, greedy, 0.0, int(np.argsort(row)[-2]), top)
