"""The batched sampler against the distribution it must draw from, written out in numpy."""
import numpy as np
import pytest
import torch

from backend.core.sampling_params import SamplingParams
from seq_states import seq_state
from backend.worker.sampler import sample


def tokens_of(logits, requests):
    return [s.token for s in sample(logits, requests)]

VOCAB = 50
DRAWS = 6000


def _expected(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    x = logits.astype(np.float64) / temperature
    if 0 < top_k < len(x):
        x = np.where(x < np.sort(x)[::-1][top_k - 1], -np.inf, x)
    p = np.exp(x - x.max())
    p /= p.sum()
    if top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        before = np.cumsum(p[order]) - p[order]  # mass of the tokens ranked above each one
        keep = np.zeros_like(p, dtype=bool)
        keep[order[before < top_p]] = True
        p = np.where(keep, p, 0.0)
        p /= p.sum()
    return p


@pytest.mark.parametrize("temperature,top_k,top_p", [
    (1.0, 0, 1.0), (0.6, 0, 1.0), (1.3, 7, 1.0), (1.0, 0, 0.7), (0.8, 10, 0.9)])
def test_draws_follow_the_filtered_softmax(temperature, top_k, top_p):
    rng = np.random.default_rng(11)
    row = rng.normal(0, 1.5, VOCAB).astype(np.float32)
    params = [SamplingParams(max_tokens=4, temperature=temperature, top_k=top_k, top_p=top_p, seed=i)
              for i in range(DRAWS)]
    requests = [seq_state(f"r{i}", [1], p) for i, p in enumerate(params)]
    tokens = tokens_of(torch.from_numpy(np.tile(row, (DRAWS, 1))), requests)
    want = _expected(row, temperature, top_k, top_p)
    got = np.bincount(tokens, minlength=VOCAB) / DRAWS
    assert set(np.flatnonzero(got)) <= set(np.flatnonzero(want)), "a filtered-out token was drawn"
    # total variation distance: about 0.04 expected from sampling noise alone at 6000 draws
    # a kept token of >= 1% mass is missing from 6000 draws with probability < 1e-26
    assert set(np.flatnonzero(want >= 0.01)) <= set(np.flatnonzero(got)), "a token that must be kept never came"
    # total variation distance: 0.015-0.035 from sampling noise alone at 6000 draws (these seeds)
    assert 0.5 * np.abs(got - want).sum() < 0.045


def test_each_request_draws_from_its_own_seeded_stream():
    rng = np.random.default_rng(3)
    logits = torch.from_numpy(rng.normal(0, 1, (3, VOCAB)).astype(np.float32))
    greedy = SamplingParams(max_tokens=4, temperature=0.0)
    seeded = SamplingParams(max_tokens=4, temperature=1.0, top_p=0.9, seed=42)

    def draws(batch_rows: list, seeded_row: int, n: int = 20) -> list[int]:
        reqs = [seq_state(f"other{i}", [1], SamplingParams(max_tokens=4, seed=i)) for i in range(len(batch_rows))]
        reqs[seeded_row] = seq_state("mine", [1], seeded)
        return [tokens_of(logits[batch_rows].clone(), reqs)[seeded_row] for _ in range(n)]

    alone = draws([0], 0)
    assert draws([1, 0, 2], 1) == alone  # other rows, another position: the same tokens
    assert len(set(alone)) > 1
    g = tokens_of(logits.clone(), [seq_state(f"g{i}", [1], greedy) for i in range(3)])
    assert g == logits.argmax(-1).tolist()


def test_top_k_minus_one_is_off_like_zero():
    """vLLM's -1 and our 0 both keep the whole vocabulary: the same draws from the same seeds."""
    rng = np.random.default_rng(5)
    logits = torch.from_numpy(rng.normal(0, 1, (64, VOCAB)).astype(np.float32))
    draws = {k: tokens_of(logits.clone(), [seq_state(f"r{i}", [1], SamplingParams(max_tokens=4, top_k=k, seed=i))
                                           for i in range(64)]) for k in (-1, 0, 3)}
    assert draws[-1] == draws[0]
    assert draws[3] != draws[0], "top_k 3 filters (the check can tell a filter from none)"


def test_greedy_tokens_are_torchs_argmax_ties_nan_and_banned_rows_included():
    """The CPU's numpy argmax (greedy_tokens) picks what torch's does: the first of equal maxima, a
    NaN over any number, index 0 of a row all -inf; on random rows of a real vocabulary's width."""
    from backend.worker.sampler import greedy_tokens
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(7, 49_153, generator=gen)
    logits[1, [10, 400, 49_000]] = 99.0          # a tie: the first wins
    logits[2, 7] = float("nan")
    logits[3] = float("-inf")                     # every token banned
    logits[4, -1] = 1e30                          # the last column
    logits[5] = 0.0
    got = greedy_tokens(logits)
    assert got.dtype == torch.int64 and torch.equal(got, logits.argmax(dim=-1))
    assert got[:6].tolist()[1:6] == [10, 7, 0, 49_152, 0]
    strided = logits[:, ::2]                      # not contiguous: still each row's argmax
    assert torch.equal(greedy_tokens(strided), strided.argmax(dim=-1))


@pytest.mark.parametrize("penalty", [{"repetition_penalty": 2.0}, {"presence_penalty": 1.0},
                                     {"frequency_penalty": 0.3}])
def test_a_greedy_row_takes_the_argmax_after_its_penalties(penalty):
    """Greedy is the argmax of the penalised logits, not the raw ones: the output's token 7 leads
    by 0.5 until its penalty, then token 9 wins; a plain greedy row beside it keeps 7."""
    logits = torch.zeros(2, VOCAB)
    logits[:, 7], logits[:, 9] = 3.0, 2.5
    rows = []
    for i, params in enumerate(({}, penalty)):
        req = seq_state(f"p{i}", [1, 2], SamplingParams(max_tokens=9, temperature=0.0, **params))
        req.output_token_ids = [7, 7]
        rows.append(req)
    assert tokens_of(logits, rows) == [7, 9]
