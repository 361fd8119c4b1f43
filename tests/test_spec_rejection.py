"""Rejection sampling keeps the target's distribution: checked by chi-square tests, first on the
rule alone (synthetic p and q, many draws), then through the engine at temperature 1 on a model
with an 8-token vocabulary (tokens with speculation against tokens without). Each test is shown
to have the power to fail: the same statistics reject rules broken in the ways that matter."""
from __future__ import annotations

import json
from collections import Counter

import pytest
import torch
from safetensors.torch import save_file

from backend import LLM, SamplingParams
from backend.models.make_model import DEFAULT_CONFIG, make_weights
from backend.worker.sampler import inverse_transform
from backend.worker import rejection
from backend.worker.rejection import _rejection_sample

VOCAB = 8
ALPHA = 1e-3


def chi2_pvalue(stat: float, df: int) -> float:
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def goodness_of_fit(counts: torch.Tensor, p: torch.Tensor) -> float:
    """p-value of counts [V] drawn from p [V] (cells expected < 5 merged)."""
    expected = p.double() * counts.sum()
    keep = expected >= 5
    obs = torch.cat([counts[keep].double(), counts[~keep].double().sum()[None]])
    exp = torch.cat([expected[keep], expected[~keep].sum()[None]])
    obs, exp = obs[exp > 0], exp[exp > 0]
    return chi2_pvalue(float(((obs - exp) ** 2 / exp).sum()), len(obs) - 1)


def homogeneity(a: Counter, b: Counter) -> float:
    """p-value that two samples of outcomes come from one distribution (rare cells merged)."""
    na, nb = sum(a.values()), sum(b.values())
    cells = sorted(set(a) | set(b), key=lambda c: -(a[c] + b[c]))
    table, other = [], [0, 0]
    for c in cells:
        if (a[c] + b[c]) * min(na, nb) / (na + nb) >= 5:
            table.append([a[c], b[c]])
        else:
            other[0] += a[c]
            other[1] += b[c]
    if sum(other):
        table.append(other)
    t = torch.tensor(table, dtype=torch.float64)
    expected = t.sum(1, keepdim=True) * t.sum(0, keepdim=True) / t.sum()
    return chi2_pvalue(float(((t - expected) ** 2 / expected).sum()), len(table) - 1)


# -- the rule alone ------------------------------------------------------------------------------
def mutant(accept_all: bool = False, residual_is_p: bool = False, rescale_u: bool = True):
    """The rule with one part broken: every draft accepted; the replacement drawn from p instead
    of norm(max(0, p - q)); or drawn with the very u that was rejected (u >= a: biased)."""
    def rule(probs, drafted, q, u):
        has = drafted >= 0
        d = drafted.clamp(min=0)[:, None]
        p = probs.double() / probs.double().sum(-1, keepdim=True)
        ratio = (p.gather(1, d) / q.double().gather(1, d)).clamp(max=1.0)[:, 0].nan_to_num(0.0)
        accepted = has & ((u < ratio) | accept_all)
        residual = p if residual_is_p else torch.where(has[:, None], (p - q.double()).clamp(min=0), p)
        u2 = ((u - ratio) / (1 - ratio).clamp(min=1e-300)).clamp(0, 1) if rescale_u else u
        token = inverse_transform(residual, torch.where(has, u2, u))
        return torch.where(accepted, drafted, token), accepted
    return rule


MUTANTS = {"accept all": mutant(accept_all=True), "residual is p": mutant(residual_is_p=True),
           "u not rescaled": mutant(rescale_u=False)}


def draws(rule, p: torch.Tensor, q: torch.Tensor, n: int, point_mass: int = -1, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if point_mass >= 0:
        drafted = torch.full((n,), point_mass)
        qs = torch.nn.functional.one_hot(drafted, VOCAB).double()
    else:
        drafted = torch.multinomial(q, n, replacement=True, generator=g)
        qs = q.double().expand(n, VOCAB)
    u = torch.rand(n, generator=g, dtype=torch.float64)
    token = rule(p.expand(n, VOCAB).clone(), drafted, qs, u)[0]
    return torch.bincount(token, minlength=VOCAB)


P = torch.tensor([0.30, 0.25, 0.0, 0.15, 0.12, 0.10, 0.05, 0.03])  # a zero: as after top-k
Q = torch.tensor([0.05, 0.40, 0.20, 0.05, 0.10, 0.0, 0.15, 0.05])  # mass where p has none, none where p has


@pytest.mark.parametrize("point_mass", [-1, 0, 1, 2, 5])
def test_the_rule_gives_p(point_mass):
    assert goodness_of_fit(draws(_rejection_sample, P, Q, 200_000, point_mass), P) > ALPHA


@pytest.mark.parametrize("name", MUTANTS)
def test_the_same_test_rejects_a_broken_rule(name):
    rule = MUTANTS[name]
    assert goodness_of_fit(draws(mutant(), P, Q, 200_000), P) > ALPHA  # the mutant generator, unbroken, passes
    assert goodness_of_fit(draws(rule, P, Q, 200_000), P) < 1e-6
    assert goodness_of_fit(draws(rule, P, Q, 200_000, point_mass=1), P) < 1e-6


# -- through the engine ---------------------------------------------------------------------------
def small_vocab_model(out, seed: int):
    """A random Llama with an 8-token vocabulary and no tokenizer (prompts are token ids); its
    output projection is scaled down so that at temperature 1 most tokens have real mass."""
    cfg = {**DEFAULT_CONFIG, "vocab_size": VOCAB, "num_hidden_layers": 2, "eos_token_id": VOCAB - 1,
           "bos_token_id": 0}
    out.mkdir(parents=True, exist_ok=True)
    weights = make_weights(cfg, seed)
    weights["lm_head.weight"] *= 0.5
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg))
    return str(out)


SAMPLE = dict(max_tokens=4, temperature=1.0, ignore_eos=True, n=64)
ENGINE = dict(cpu_kv_cache_tokens=16384, max_num_seqs=256)


def outcomes(llm: LLM, prompts: list[list[int]], repeats: int = 12, **params) -> dict[str, Counter]:
    """The tokens of many completions: each position's marginal and the first two tokens' pair."""
    counts: dict[str, Counter] = {}
    for _ in range(repeats):
        for i, out in enumerate(llm.generate(prompts, SamplingParams(**{**SAMPLE, **params}))):
            for s in out.samples:
                t = s.token_ids
                for j in range(len(t)):
                    counts.setdefault(f"prompt {i}, token {j}", Counter())[t[j]] += 1
                counts.setdefault(f"prompt {i}, tokens 0-1", Counter())[tuple(t[:2])] += 1
    llm.check_integrity()
    return counts


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("vocab8")
    return small_vocab_model(root / "target", 0), small_vocab_model(root / "draft", 1)


@pytest.fixture(scope="module")
def prompts(models):
    """The target's own greedy continuations: they repeat themselves, so n-gram drafts are tokens
    the target finds likely (p(d) in the middle, where a broken rule distorts the most)."""
    starts = [[1], [2, 5], [3, 4, 6]]
    outs = LLM(models[0], **ENGINE).generate(starts, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    return [s + o.token_ids for s, o in zip(starts, outs)]


@pytest.fixture(scope="module")
def reference(models, prompts):
    return outcomes(LLM(models[0], seed=1, **ENGINE), prompts)


SPECS = {"ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2},
         "draft, greedy": {"num_speculative_tokens": 3},
         "draft, probabilistic": {"num_speculative_tokens": 3, "draft_sample_method": "probabilistic"}}


@pytest.mark.slow
@pytest.mark.parametrize("name", SPECS)
def test_temperature_one_distribution_is_unchanged(models, prompts, reference, name):
    target, draft = models
    spec = dict(SPECS[name], **({"model": draft} if name.startswith("draft") else {}))
    llm = LLM(target, seed=2, speculative_config=spec, **ENGINE)
    counts = outcomes(llm, prompts)
    stats = llm.stats()
    assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]  # both paths taken
    pvalues = {k: homogeneity(counts[k], reference[k]) for k in reference}
    assert min(pvalues.values()) > ALPHA / len(pvalues), sorted(pvalues.items(), key=lambda kv: kv[1])[:3]


@pytest.mark.parametrize("name", ["residual is p", "u not rescaled"])
def test_the_engine_level_test_rejects_a_broken_rule(models, prompts, reference, monkeypatch, name):
    """The same statistics, with the rule broken in the engine."""
    monkeypatch.setattr(rejection, "_rejection_sample", MUTANTS[name])
    llm = LLM(models[0], seed=2, speculative_config=SPECS["ngram"], **ENGINE)
    counts = outcomes(llm, prompts)
    assert min(homogeneity(counts[k], reference[k]) for k in reference) < 1e-8


@pytest.mark.slow
def test_filtered_distributions_too(models, prompts):
    """Temperature, top-k and top-p make p at each position (zeros included): still unchanged."""
    filtered = dict(temperature=0.7, top_k=5, top_p=0.9)
    ref = outcomes(LLM(models[0], seed=3, **ENGINE), prompts, **filtered)
    llm = LLM(models[0], seed=4, speculative_config=SPECS["ngram"], **ENGINE)
    counts = outcomes(llm, prompts, **filtered)
    assert llm.stats()["spec_decode_num_accepted_tokens"] > 0
    pvalues = {k: homogeneity(counts[k], ref[k]) for k in ref}
    assert min(pvalues.values()) > ALPHA / len(pvalues), sorted(pvalues.items(), key=lambda kv: kv[1])[:3]
