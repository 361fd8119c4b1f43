"""The sampler on a GPU: one read back to the host per step (the tokens and logprobs of every row,
packed), and a fixed number of transfers to the device whatever the number of penalised, banned,
logprob or randomly sampled rows: nothing read or built per row. Counted on the CPU, where the
same calls would be device transfers on a GPU."""
import pytest
import torch

from backend.worker import sampler
from backend.core.sampling_params import SamplingParams
from seq_states import seq_state

TO = torch.Tensor.to
READS = ("tolist", "item", "__bool__", "__int__", "__float__", "__index__", "cpu", "to")  # numpy() refuses GPU tensors


@pytest.fixture
def transfers(monkeypatch):
    counts = {"to_host": 0, "to_device": 0}

    def counted(original, key):
        def wrapper(*a, **k):
            if original is not TO or any(str(x) == "cpu" for x in (*a[1:], k.get("device"))):
                counts[key] += 1   # .to() is a read back only when it goes to the CPU
            return original(*a, **k)
        return wrapper

    for name in READS:
        monkeypatch.setattr(torch.Tensor, name, counted(getattr(torch.Tensor, name), "to_host"))
    for name in ("tensor", "from_numpy", "as_tensor"):
        monkeypatch.setattr(torch, name, counted(getattr(torch, name), "to_device"))
    return counts


def _requests(n: int) -> list:
    """Every kind of row: greedy, random with top-k/top-p, penalties, bans (min_tokens, bad words),
    logprobs, in a mix that grows with n."""
    out = []
    for i in range(n):
        kind = i % 4
        p = SamplingParams(max_tokens=9, temperature=0.0 if kind == 0 else 0.9, top_k=5 if kind == 1 else 0,
                           top_p=0.8 if kind == 1 else 1.0, repetition_penalty=1.3 if kind == 2 else 1.0,
                           frequency_penalty=0.5 if kind == 2 else 0.0, presence_penalty=0.25 if kind == 2 else 0.0,
                           logprobs=3 if kind in (0, 3) else None, min_tokens=4 if kind == 3 else 0, seed=i)
        req = seq_state(f"r{i}", [3, 4, 5, 4, 9 + i], p, eos_token_ids=(2,))
        req.output_token_ids = [7, 7, 8][: 1 + i % 3]
        req.bad_words_ids = [[7, 11]] if kind == 1 else []
        out.append(req)
    return out


@pytest.mark.parametrize("rows", [4, 24])
def test_one_read_back_and_a_fixed_number_of_transfers_per_step(transfers, rows):
    logits = 2 * torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows))
    out = sampler.sample(logits, _requests(rows))
    assert len(out) == rows and all(o.logprob is not None for i, o in enumerate(out) if i % 4 in (0, 3))
    assert transfers == {"to_host": 1, "to_device": 2}, transfers


def test_a_step_of_plain_greedy_rows_reads_back_once_and_sends_nothing(transfers):
    """The common step, every row greedy with nothing to apply, skips the plan: one read back of
    the argmax, the same tokens the general path picks (ties to the first, a NaN row's NaN)."""
    logits = torch.randn(6, 64, generator=torch.Generator().manual_seed(6))
    logits[1, [5, 9]] = 10.0  # a tie: the first wins
    logits[4, 17] = float("nan")
    plain = [seq_state(f"g{i}", [3, 4, 5], SamplingParams(max_tokens=9, temperature=0.0), eos_token_ids=(2,))
             for i in range(6)]
    asking = [seq_state(f"l{i}", [3, 4, 5], SamplingParams(max_tokens=9, temperature=0.0, logprobs=1 if i == 0 else None),
                      eos_token_ids=(2,)) for i in range(6)]
    general = [o.token for o in sampler.sample(logits.clone(), asking)]
    transfers.update(to_host=0, to_device=0)
    fast = [o.token for o in sampler.sample(logits.clone(), plain)]
    assert fast == general and fast[1] == 5 and fast[4] == 17
    assert transfers == {"to_host": 1, "to_device": 0}, transfers
