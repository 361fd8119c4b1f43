"""The n sequences of one prompt (n > 1 completions; a beam search's beams, backend/sched/beams.py):
which waits for which, and a beam search's family started as one. No torch here.

A later completion forks its first's full prompt blocks, so it runs once the first has computed
them. Sampled completions are independent: each starts when it fits (as vLLM's child requests).
A search waits for all its beams, so its beams start in the step its first does or not at all:
the first's admission counts their blocks (policies.GuaranteedNoEvict.family_blocks), and the
later beams run (fork, compute the prompt's last block) once the first's prompt is computed; until
then they are `parked`: running, holding no block, their reservation kept.
"""
from __future__ import annotations

from typing import Optional, Sequence

from backend.core.request import Request
from backend.sched.pool import RequestPool


def first_sibling(running: Sequence[Request], req: Request) -> Optional[Request]:
    if req.index == 0:
        return None
    return next((r for r in running if r.request_id == req.request_id and r.index == 0), None)


def waits_for_sibling(running: Sequence[Request], req: Request, unstarted: set[str]) -> bool:
    """A later completion waits until the first one has computed the prompt it will share. The
    first, when it still waits, comes before it in the queue (same priority, earlier arrival),
    so the admission pass has passed it over (`unstarted`): no search of the queue."""
    first = first_sibling(running, req)
    if first is None:
        return req.request_id in unstarted
    return first.num_computed_tokens < req.num_prompt_tokens - 1


def family_size(req: Request) -> int:
    """The sequences that start with req: a beam search's first starts all its beams."""
    return req.params.n if req.params.use_beam_search and not req.index else 1


def start_family(pool: RequestPool, first: Request, later: Sequence[Request], now: float, step: int) -> None:
    """A beam search's later beams (among `later`, the queue after its first) start with it, parked."""
    for req in later:
        if req.request_id == first.request_id:
            req.parked = True
            pool.start(req, 0, now, step)
