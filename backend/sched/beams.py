"""Beam search on shared blocks (the PagedAttention paper's showcase): a request with
use_beam_search is `best_of` sequences (its beams, index 0..N-1) that the scheduler runs as the n
completions of one prompt are run, all started in one step (siblings.py: the later ones wait for the
first's prompt and fork its full blocks). No torch here.

Each beam's row asks the worker for its top 2N raw log-probabilities (`Sampled.top`, through the
step contract; the beams' own `params` ask for them). `BeamGroups.take` pulls those results out of
the step's before the scheduler's postprocess sees them, so no beam appends the worker's token;
once every beam of a request has its numbers for the same length, `advance` makes the step's choice
(beam_select.py) and applies it:
- a beam that goes on from itself keeps its table and appends its token;
- a beam whose slot goes to another's continuation takes that beam's history copy-on-write
  (`KVCacheGroups.adopt`: the full blocks shared, reference counted; the partly filled last block
  copied into a block of its own, which the plan's `block_copies` make before the next step writes),
  and the worker is told its tokens from the first that differs (`WorkerView.rewrite`).
When the search ends every beam is finished (its blocks go back) and the best n hypotheses go out,
one final output each, best first. Nothing is streamed before (the beams' tokens may still change).
"""
from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from typing import Optional

from backend.core.outputs import CoreOutput
from backend.core.request import Request, RequestStatus
from backend.sched.beam_select import BeamSearch


@dataclass
class _Group:
    beams: list[Request]
    search: BeamSearch
    n: int
    tops: dict[int, list] = field(default_factory=dict)  # slot -> its numbers at the current length
    logprobs: bool = False  # the request asked for logprobs (0: each token's own)


class BeamGroups:
    def __init__(self, blocks, worker_view, finish):
        """`blocks`: the scheduler's KVCacheGroups; `worker_view`: its WorkerView; `finish`: its
        finish(request, status)."""
        self.blocks, self.worker_view, self.finish = blocks, worker_view, finish
        self.groups: dict[str, _Group] = {}
        self.slot_of: dict[str, tuple[str, int]] = {}  # seq_id -> (request id, slot)
        self.copies: list[tuple[int, int]] = []  # for the next plan
        self.requests_total = 0
        # beams of unfinished searches (the metrics' gauge): a count, as stats() may be read from
        # another thread while this one changes the groups
        self.num_running = 0

    def start(self, request: Request) -> None:
        """A beam request arrives: its search begins, and its params become the beams' own (made
        before its beams are, which share them): greedy, n the beam width (what admission reserves
        for), and the top `keep` raw logprobs asked of each row (not re-validated: more than a
        user may ask). The caller's params (n returned) stay with the delivery side."""
        p = request.params
        search = BeamSearch(p.beam_width, p.max_tokens, request.eos_token_ids + tuple(p.stop_token_ids),
                            p.length_penalty, p.early_stopping)
        row = copy.copy(p)
        row.n, row.temperature, row.logprobs = p.beam_width, 0.0, search.keep
        request.params = row
        self.groups[request.request_id] = _Group([], search, p.n, logprobs=p.logprobs is not None)
        self.requests_total += 1

    def add(self, beam: Request) -> None:
        """One of its beams (index = slot), in order."""
        self.groups[beam.request_id].beams.append(beam)
        self.num_running += 1
        self.slot_of[beam.seq_id] = (beam.request_id, beam.index)

    def take(self, sampled: dict) -> None:
        """Move the beams' results out of a step's `sampled` (seq_id -> Sampled) into their groups."""
        for seq_id in [s for s in sampled if s in self.slot_of]:
            request_id, slot = self.slot_of[seq_id]
            self.groups[request_id].tops[slot] = sampled.pop(seq_id).top

    def take_copies(self) -> list[tuple[int, int]]:
        copies, self.copies = self.copies, []
        return copies

    def advance(self) -> list[CoreOutput]:
        """Choose for every request whose beams all have their numbers; the final outputs of the
        searches that ended."""
        outputs = []
        for request_id, g in list(self.groups.items()):
            if len(g.tops) < len(g.beams) or any(b.status is not RequestStatus.RUNNING
                                                 or b.num_computed_tokens < b.num_tokens for b in g.beams):
                continue  # (a beam preempted after it answered computes its tokens again first)
            running = g.search.step([g.tops[j] for j in range(len(g.beams))], [b.output_token_ids for b in g.beams])
            g.tops.clear()
            if running:
                self._reassign(g, running)
            else:
                outputs += self._end(request_id, g)
        return outputs

    def _reassign(self, g: _Group, running) -> None:
        children: dict[int, list] = {}
        for c in running:
            children.setdefault(c.parent, []).append(c)
        spare = [j for j in range(len(g.beams)) if j not in children]
        assign = {}
        for parent, cs in children.items():
            assign[parent] = cs[0]  # a parent keeps its own slot (and table) for its first child
            for c in cs[1:]:
                assign[spare.pop()] = c
        g.search.scores = [assign[j].score for j in range(len(g.beams))]  # by slot, as the beams now stand
        g.search.logprobs = [assign[j].logprobs for j in range(len(g.beams))]
        histories = [list(b.output_token_ids) for b in g.beams]
        now = time.monotonic()
        for slot, c in assign.items():
            req = g.beams[slot]
            if c.parent != slot:
                parent = g.beams[c.parent]
                self.copies += self.blocks.adopt(parent.seq_id, req.seq_id, parent.num_computed_tokens)
                old, new = req.output_token_ids, histories[c.parent]
                same = next((i for i, (a, b) in enumerate(zip(old, new)) if a != b), min(len(old), len(new)))
                self.worker_view.rewrite(req.seq_id, req.num_prompt_tokens + same)
                req.output_token_ids = list(new)
            req.output_token_ids.append(c.token)
            if req.first_token_time is None:
                req.first_token_time = now

    def _end(self, request_id: str, g: _Group) -> list[CoreOutput]:
        self._forget(request_id, g)
        for b in g.beams:
            self.finish(b, RequestStatus.FINISHED_STOPPED)
        first = g.beams[0]
        return [CoreOutput(request_id, i, h.token_ids, [(lp, rank, []) for lp, rank in h.logprobs] if g.logprobs else None,
                           "stop" if h.eos else "length",
                           h.token_ids[-1] if h.eos else None, num_cached_tokens=first.num_cached_tokens)
                for i, h in enumerate(g.search.best(g.n))]

    def _forget(self, request_id: str, g: _Group) -> None:
        del self.groups[request_id]
        self.num_running -= len(g.beams)
        for b in g.beams:
            self.slot_of.pop(b.seq_id, None)

    def filter(self, outputs: list[CoreOutput]) -> list[CoreOutput]:
        """Outputs of beams that ended otherwise (aborted, failed): one final output for each of
        the n returned, none for the other beams; the search's other beams are finished too."""
        kept, ended = [], {}
        for o in outputs:
            g = self.groups.get(o.request_id)
            if g is None:
                kept.append(o)
            elif o.finished:
                ended.setdefault(o.request_id, {})[o.index] = o
        for request_id, finals in ended.items():
            g = self.groups[request_id]
            self._forget(request_id, g)
            some: Optional[CoreOutput] = next(iter(finals.values()))
            status = RequestStatus(some.finish_reason)
            for b in g.beams:
                if not b.status.finished:
                    self.finish(b, status)
            kept += [finals.get(i) or CoreOutput(request_id, i, [], None, some.finish_reason, None, some.error,
                                                 some.error_kind) for i in range(g.n)]
        return kept


def refuse_beams(params, config, blocks, prompt_len: int) -> None:
    """What beam search does not compose with in this engine (the request's own settings are
    checked by SamplingParams), and a search whose beams could never run at once (ValueError)."""
    if not params.use_beam_search:
        return
    if config.speculative is not None:
        raise ValueError("use_beam_search is not supported with speculative decoding (speculative_config is set)")
    if config.batch_scheduler_policy != "guaranteed_no_evict":
        raise ValueError(f"use_beam_search needs batch_scheduler_policy guaranteed_no_evict (this engine runs "
                         f"{config.batch_scheduler_policy}): a search waits for all its beams, which its "
                         "reservation keeps running; a preempted beam could hold the others forever")
    if config.batching_mode in ("static", "dynamic"):
        raise ValueError(f"use_beam_search is not supported with batching_mode {config.batching_mode} (padded "
                         "batches); use inflight")
    need = blocks.blocks_for(prompt_len + params.max_tokens - 1)
    shared = (prompt_len - 1) // blocks.block_size if len(blocks.groups) == 1 else 0
    total = need + (params.beam_width - 1) * (need - shared)
    if total > blocks.num_blocks:
        raise ValueError(f"best_of ({params.beam_width} beams) of prompt ({prompt_len} tokens) + max_tokens "
                         f"({params.max_tokens}) need {total} KV blocks at once; the cache has {blocks.num_blocks}")
