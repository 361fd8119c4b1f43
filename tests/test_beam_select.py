"""Beam search's choice of each step (backend/sched/beam_select.py) against transformers'
generate(num_beams=N, do_sample=False) on the same logits: both read one tiny random Llama's
log-probabilities (transformers computes them for each beam's history here), so only the choice is
compared: candidates, EOS hypotheses, length penalty, the early_stopping modes, max_new_tokens."""
from __future__ import annotations

import pytest
import torch

from backend.sched.beam_select import BeamSearch
from hf_checkpoints import make_checkpoint

PROMPT = [5, 17, 99, 200, 31, 7, 8]  # 7 tokens: not a block multiple


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    import transformers as tf
    path = make_checkpoint("llama", tmp_path_factory.mktemp("beam-llama"))
    return tf.AutoModelForCausalLM.from_pretrained(path).eval()


def ours(model, width, max_tokens, eos, length_penalty, early_stopping, n):
    search = BeamSearch(width, max_tokens, eos, length_penalty, early_stopping)
    histories = [[] for _ in range(width)]
    while True:
        with torch.no_grad():
            logits = model(torch.tensor([PROMPT + h for h in histories])).logits[:, -1].float()
        top = torch.log_softmax(logits, -1).topk(search.keep)
        tops = [list(zip(i.tolist(), v.tolist())) for v, i in zip(top.values, top.indices)]
        running = search.step(tops, histories)
        if not running:
            return search.best(n)
        histories = [histories[c.parent] + [c.token] for c in running]


def theirs(model, width, max_tokens, eos, length_penalty, early_stopping, n):
    out = model.generate(torch.tensor([PROMPT]), num_beams=width, do_sample=False, max_new_tokens=max_tokens,
                         num_return_sequences=n, eos_token_id=list(eos), pad_token_id=0,
                         length_penalty=length_penalty, early_stopping=early_stopping,
                         output_scores=True, return_dict_in_generate=True)
    return out.sequences[:, len(PROMPT):].tolist(), out.sequences_scores.tolist()


# eos: none that occurs; one the beams meet often (237); two (267 and 293: several hypotheses early)
CASES = [(2, 9, (2,), 1.0, False, 2), (4, 10, (2,), 1.0, False, 4), (4, 10, (237,), 1.0, False, 3),
         (4, 10, (237,), 1.0, True, 4), (4, 10, (237,), 2.0, "never", 4), (2, 8, (267, 293), 0.0, False, 2),
         (4, 9, (267, 293), -0.5, "never", 2), (4, 12, (349,), 1.0, True, 2)]


@pytest.mark.parametrize("width,max_tokens,eos,length_penalty,early_stopping,n", CASES)
def test_beams_equal_transformers(hf_model, width, max_tokens, eos, length_penalty, early_stopping, n):
    got = ours(hf_model, width, max_tokens, eos, length_penalty, early_stopping, n)
    sequences, scores = theirs(hf_model, width, max_tokens, eos, length_penalty, early_stopping, n)
    assert len(got) == n
    for hyp, seq, score in zip(got, sequences, scores):
        assert seq[:len(hyp.token_ids)] == hyp.token_ids
        assert all(t == (eos[0] if hyp.eos else 0) or t in eos for t in seq[len(hyp.token_ids):])  # padding
        assert hyp.score == pytest.approx(score, abs=1e-4)
        assert hyp.eos == (hyp.token_ids[-1] in eos)


def test_first_step_counts_only_the_first_beam():
    search = BeamSearch(2, 5)
    tops = [[(7, -0.1), (8, -0.2), (9, -3.0), (10, -4.0)], [(11, -0.01), (12, -0.02), (13, -0.03), (14, -0.04)]]
    running = search.step(tops, [[], []])
    assert [(c.parent, c.token) for c in running] == [(0, 7), (0, 8)]


def test_max_tokens_one_finishes_every_beam_at_once():
    search = BeamSearch(2, 1, eos_ids=(3,))
    assert search.step([[(7, -0.5), (3, -1.0), (8, -2.0), (9, -3.0)]] * 2, [[], []]) == []
    assert search.done and [h.token_ids for h in search.best(2)] == [[7], [3]]
    assert [h.eos for h in search.best(2)] == [False, True]


@pytest.mark.parametrize("width,max_tokens,eos,length_penalty,early_stopping,n", [CASES[2], CASES[4]])
def test_each_hypothesis_keeps_its_tokens_logprobs_and_ranks(hf_model, width, max_tokens, eos, length_penalty,
                                                             early_stopping, n):
    """The logprobs a beam carries (TensorRT-LLM's output_log_probs / cum_log_probs): each token's
    log_softmax under its own history, its rank there; their sum is the score before the length
    penalty."""
    for hyp in ours(hf_model, width, max_tokens, eos, length_penalty, early_stopping, n):
        with torch.no_grad():
            logits = hf_model(torch.tensor([PROMPT + hyp.token_ids])).logits[0, len(PROMPT) - 1:-1].float()
        table = torch.log_softmax(logits, -1)
        want = [table[k, t].item() for k, t in enumerate(hyp.token_ids)]
        ranks = [1 + int((table[k] > table[k, t]).sum()) for k, t in enumerate(hyp.token_ids)]
        assert [lp for lp, _ in hyp.logprobs] == pytest.approx(want, abs=1e-4)
        assert [rank for _, rank in hyp.logprobs] == ranks
        assert sum(want) / len(hyp.token_ids) ** length_penalty == pytest.approx(hyp.score, abs=1e-4)
