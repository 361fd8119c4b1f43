"""Sequences as the worker holds them (backend/worker/input_batch.SeqState), made the way a step plan
introduces them, for the tests of the sampler and the rejection sampler. The arguments are those
of backend.core.request.Request, so a test can swap one for the other."""
from backend.core.step import NewSeq
from backend.worker.input_batch import SeqState


def seq_state(seq_id, prompt, params, eos_token_ids=(), arrival_time=None, seed=0, priority=0, index=0,
              output=(), bad_words_ids=()):
    return SeqState(NewSeq(seq_id, list(prompt), list(output), params, seed, index, tuple(eos_token_ids),
                           [list(w) for w in bad_words_ids], None, ((),), 0))
