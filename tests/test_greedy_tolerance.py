"""gpu-check's greedy tolerance (client/tools/gpu_check/greedy.py) cannot fail a correct bf16
engine and still fails a wrong one: a simulation of the check over 10,240 positions at the logit
magnitudes of the check's model (make_model's LM head, 32000 tokens: top logits ~22-37, where a bf16
step is 0.125-0.25).

The final hidden state is the sum of 17 residual contributions (the embedding and 16 layers),
RMS-normalised. A bf16 implementation leaves it off by a relative error eps (measured on the
check's model, transformers bf16 against float32 on the CPU: 2.6% on average, 3.5% at most), then
rounds its input to the LM head, the LM head's weights and its logits to bf16 (a bf16 GEMM:
float32 accumulation of bf16 operands). The reference (transformers bf16) and a correct engine are
two such implementations with independent errors; the wrong engine replaces one layer's
contribution by another of the same size. The engine's token is its own argmax; the check judges it
with the reference's logits, as on the GPU.
"""
import pytest
import torch

from client.tools.gpu_check.greedy import judge, merge, tolerance, ulp, ulps

VOCAB, HIDDEN, LAYERS, POSITIONS, CHUNK = 32000, 128, 16, 10240, 1024
LM_HEAD_STD = 0.2 * (1024 / HIDDEN) ** 0.5   # the logits' std of make_model's LM head at the check's hidden size (6.4)
MEASURED_EPS = 0.035


def _rms(x):
    return x / x.pow(2).mean(-1, keepdim=True).sqrt()


def _bf16(x):
    return x.to(torch.bfloat16).float()


@pytest.fixture(scope="module")
def simulation():
    g = torch.Generator().manual_seed(0)
    w = _bf16(torch.randn(VOCAB, HIDDEN, generator=g) * LM_HEAD_STD)
    contributions = torch.randn(POSITIONS, LAYERS + 1, HIDDEN, generator=g)
    pre = contributions.sum(1)
    wrong = pre - contributions[:, 5] + torch.randn(POSITIONS, HIDDEN, generator=g)   # layer 5 computes something else

    def logits(hidden, eps, rows):
        h = hidden[rows]
        noise = eps * h.pow(2).mean(-1, keepdim=True).sqrt() * torch.randn(h.shape, generator=g)
        return _bf16(_bf16(_rms(h + noise)) @ w.T)

    def run(engine_hidden, engine_eps, reference_eps=MEASURED_EPS):
        rows = []
        for start in range(0, POSITIONS, CHUNK):
            chunk = slice(start, start + CHUNK)
            reference = logits(pre, reference_eps, chunk)
            tokens = logits(engine_hidden, engine_eps, chunk).argmax(-1)
            rows.append(judge(reference, tokens, "bfloat16", LAYERS) | dict(top=reference.max(-1).values))
        return rows

    return pre, wrong, run


def test_the_tolerance_is_the_dtypes_rounding_at_the_logits_magnitude():
    top = torch.tensor([1.0, 26.0, 31.9, 32.0, 35.0, -40.0])
    assert ulp(top, "bfloat16").tolist() == [2 ** -7, 0.125, 0.125, 0.25, 0.25, 0.25]
    assert ulp(torch.tensor([26.0]), "float32").item() == 2.0 ** (4 - 23)
    assert ulps(16) == 26 and ulps(1) == 8
    assert tolerance(torch.tensor([26.0]), "bfloat16", 16).item() == 26 * 0.125


@pytest.mark.slow
def test_a_correct_bf16_engine_passes_over_10k_positions(simulation):
    pre, _, run = simulation
    rows = run(pre, engine_eps=2 * MEASURED_EPS)        # twice the measured error, in the engine
    res = merge([{k: v for k, v in r.items() if k != "top"} for r in rows])
    assert res["positions"] == POSITIONS == 10240
    assert res["ok"] and res["over"] == 0, res
    assert res["first_diff"] is not None and res["exact"] < POSITIONS   # rounding does flip tokens
    top = torch.cat([r["top"] for r in rows])
    assert 20 < top.min() and top.max() < 40                         # the check's logit magnitudes
    # the old fixed near-tie (0.125) failed this correct engine
    assert res["max_gap"] > 0.125


@pytest.mark.slow
def test_an_engine_with_a_wrong_layer_fails(simulation):
    _, wrong, run = simulation
    res = merge([{k: v for k, v in r.items() if k != "top"} for r in run(wrong, engine_eps=MEASURED_EPS)])
    assert not res["ok"] and res["over"] > POSITIONS // 20, res
    first = res["first_diff"]
    assert first["engine_token"] != first["reference_token"]
    assert first["reference_top_logit"] - first["engine_token_logit"] == pytest.approx(first["gap"])


def test_judge_reports_the_first_difference_with_both_logits():
    logits = torch.tensor([[1.0, 5.0, 2.0], [30.0, 29.0, 1.0], [0.0, 1.0, 50.0]])
    res = judge(logits, torch.tensor([1, 1, 0]), "bfloat16", 16)
    assert res["exact"] == 1 and res["positions"] == 3
    assert res["first_diff"] == dict(position=1, engine_token=1, reference_token=0, engine_token_logit=29.0,
                                     reference_top_logit=30.0, gap=1.0, tolerance=26 * 0.125)
    assert res["over"] == 1 and res["max_gap"] == 50.0                    # position 2: 50 apart
