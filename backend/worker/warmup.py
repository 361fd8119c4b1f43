"""The warm-up's steps: the largest an engine takes, run on a throwaway cache before the KV cache
is sized (backend/kv/sizing.py). They leave the activation peak in the allocator's statistics and
compile every kernel variant serving can launch, so no first use stalls a request:

- a prefill of the whole token budget (max_num_batched_tokens, or max_model_len when smaller):
  prefill attention, the KV store, RoPE, RMSNorm with and without the residual, SiLU-mul;
- decode steps of max_num_seqs rows, of a single row and, when max_num_seqs is larger, of the
  quantized GEMMs' largest decode tile (kernels/gpu/quant_tiles.py: 16 rows, up to DECODE_MAX_M = 64
  rows, then the prefill tile): decode attention's split-K and one-pass variants (the split count
  only falls as the batch grows, so one and max_num_seqs rows reach every variant any batch size
  can) and each M tile of the quantized GEMMs. With CUDA graphs the captured sizes (1, 2, 4, 8,
  16, 32, ...) reach those tiles too; with enforce_eager and max_num_seqs > 64 only this step
  does, or the first decode batch of 17-64 rows would compile it while serving;
- the sampler on every decode row with every option on (temperature, top-k, top-p, the three
  penalties, min_tokens bans, the most logprobs a request may ask for): its peak memory.
"""
from __future__ import annotations

from typing import Iterator

from backend.core.sampling_params import MAX_LOGPROBS, SamplingParams
from backend.core.step import NewSeq, Row, StepPlan

# Every sampler option on: the costliest sampling a step can ask for.
PARAMS = dict(max_tokens=2, temperature=0.8, top_k=50, top_p=0.9, repetition_penalty=1.1,
              frequency_penalty=0.1, presence_penalty=0.1, min_tokens=2, logprobs=MAX_LOGPROBS, seed=0,
              min_p=0.01, logit_bias={1: 0.5})


def prefill_tokens(max_num_batched_tokens: int, max_model_len: int) -> int:
    return max(1, min(max_num_batched_tokens, max_model_len))


def decode_rows(max_num_seqs: int) -> list[int]:
    """The decode batch sizes the warm-up runs: max_num_seqs, 1, and every tile boundary between."""
    from kernels.gpu.quant_tiles import DECODE_M_TILES  # (16, 64): the quantized GEMMs' decode tiles

    return sorted({max_num_seqs, 1, *(min(m, max_num_seqs) for m in DECODE_M_TILES)}, reverse=True)


def warm_up_steps(max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int, block_size: int,
                  vocab_size: int, groups: int = 1) -> Iterator[StepPlan]:
    """The warm-up's step plans, each of sequences of its own (the previous step's are finished in
    the next). Their block tables use blocks 0 .. the prefill's count - 1, the same in every
    KV-cache group (a throwaway cache: every group may write the same blocks)."""
    n = prefill_tokens(max_num_batched_tokens, max_model_len)
    eos = (vocab_size - 1,)   # banned by min_tokens
    params = SamplingParams(**PARAMS)
    prompt = [1 + i % (vocab_size - 2) for i in range(n)]
    table = list(range(-(-n // block_size)))
    held = ["warm-up-prefill"]
    yield StepPlan(new_seqs=[NewSeq(held[0], prompt, [], params, 0, 0, eos, [], None, (table,) * groups, 0)],
                   prefills=[Row(held[0], 0, n)])
    for rows in decode_rows(max_num_seqs):
        ids = [f"warm-up-{rows}-{i}" for i in range(rows)]
        table = [0] * -(-3 // block_size)
        yield StepPlan(new_seqs=[NewSeq(sid, [1, 2], [3], params, i, 0, eos, [], None, (table,) * groups, 2)
                                 for i, sid in enumerate(ids)],
                       decodes=[Row(sid, 2, 1) for sid in ids], finished_ids=held)
        held = ids
