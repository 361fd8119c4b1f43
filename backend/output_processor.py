"""From sampled tokens to what callers see (vLLM's OutputProcessor pattern): incremental
detokenizing, stop strings, logprobs, outputs held back for padded batches, and the building of
every `RequestOutput`. The engine's step ends by handing its results here."""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional

from backend.outputs import Logprob, RequestOutput, StopStringMatcher, TokenLogprobs, merge_outputs
from backend.request import Request, RequestStatus, seq_id_of
from backend.detokenizer import IncrementalDetokenizer
from backend.tokenizer import Tokenizer

Finish = Callable[[Request, RequestStatus], None]


class _State:
    """One sequence's text state."""
    __slots__ = ("detok", "stops")

    def __init__(self, detok: Optional[IncrementalDetokenizer], stops: StopStringMatcher):
        self.detok, self.stops = detok, stops


class OutputProcessor:
    def __init__(self, tokenizer: Optional[Tokenizer], hold_until_released: bool = False):
        self.tokenizer = tokenizer
        # Padded batches answer when the batch ends, as one padded generate call per batch would.
        self.hold_until_released = hold_until_released
        self._states: dict[str, _State] = {}
        self._held: dict[str, RequestOutput] = {}

    def add(self, req: Request) -> None:
        detok = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids) if self.tokenizer else None
        self._states[req.seq_id] = _State(detok, StopStringMatcher(req.params.stop))

    # -- after a step ---------------------------------------------------------------------------
    def step_outputs(self, requests: list[Request], sampled: dict, finish: Finish,
                     released: list[Request]) -> list[RequestOutput]:
        """Outputs for the requests that sampled a token this step (`sampled`: seq_id -> Sampled);
        `finish` ends a request whose stop string completed; `released`: padded-batch members whose
        batch ended."""
        results = []
        for req in requests:
            s = sampled.get(req.seq_id)
            if s is not None:
                results.append(self._output(req, [s.token], finish, [self._logprobs(s)] if s.logprob is not None else None))
        return self._hold(results, released) if self.hold_until_released else results

    def _logprobs(self, s) -> TokenLogprobs:
        entries = {tok: Logprob(lp, rank + 1, self._piece(tok)) for rank, (tok, lp) in enumerate(s.top)}
        entries[s.token] = Logprob(s.logprob, s.rank, self._piece(s.token))
        return entries

    def _piece(self, token: int) -> str:
        return self.tokenizer.decode([token], skip_special_tokens=False) if self.tokenizer else ""

    def _output(self, req: Request, new_ids: list[int], finish: Finish,
                new_logprobs: Optional[list[TokenLogprobs]] = None) -> RequestOutput:
        """Detokenize new tokens, apply stop strings, and package what the caller sees."""
        state = self._states[req.seq_id]
        delta = ""
        if state.detok is not None:
            # vLLM v1: the EOS or stop token that ended a request is in its token ids, not its text
            text_ids = new_ids[:-1] if new_ids and req.stop_token_id is not None else new_ids
            delta = state.detok.add(text_ids) if text_ids else ""
            if req.status.finished:
                delta += state.detok.flush()
        # vLLM checks stop strings only once more than min_tokens tokens were generated
        if state.stops.feed(delta, check=len(req.output_token_ids) > req.params.min_tokens):
            if not req.status.finished:
                finish(req, RequestStatus.FINISHED_STOPPED)
            elif req.status is RequestStatus.FINISHED_LENGTH:  # the stop string ended on the last token
                req.status = RequestStatus.FINISHED_STOPPED
        if new_logprobs:
            req.logprobs.extend(new_logprobs)
            req.cumulative_logprob += sum(lp[t].logprob for lp, t in zip(new_logprobs, new_ids))
        if req.status.finished:
            del self._states[req.seq_id]
        new_text = state.stops.emit(final=req.status.finished)
        queued = None
        if len(req.output_token_ids) == len(new_ids) and new_ids and req.admitted_time is not None:
            queued = max(0.0, req.admitted_time - req.arrival_time)  # its first token: report the wait once
        return RequestOutput(req.request_id, req.prompt_token_ids, new_ids, list(req.output_token_ids),
                             new_text, state.stops.emitted, req.status.finished, req.finish_reason, req.error,
                             index=req.index, new_logprobs=new_logprobs,
                             logprobs=req.logprobs, cumulative_logprob=req.cumulative_logprob,
                             queue_seconds=queued)

    def _hold(self, outputs: list[RequestOutput], released: list[Request]) -> list[RequestOutput]:
        """Padded batches: hold each member's outputs, merged, until its batch ends; aborts and
        errors answer at once."""
        ready = []
        for o in outputs:
            key = seq_id_of(o.request_id, o.index)
            merged = merge_outputs(self._held.pop(key, None), o)
            if o.finished and o.finish_reason in ("abort", "error"):
                ready.append(merged)
            else:
                self._held[key] = merged
        ready.extend(self._held.pop(r.seq_id) for r in released if r.seq_id in self._held)
        return ready

    def release(self, released: list[Request]) -> list[RequestOutput]:
        return self._hold([], released) if self.hold_until_released else []

    # -- requests that end outside a step --------------------------------------------------------
    def ended(self, req: Request, finish: Finish) -> RequestOutput:
        """The final output of a request that was aborted or failed (already finished by the
        scheduler): what it held back, and its state."""
        held = self._held.pop(req.seq_id, None)
        if req.seq_id not in self._states:  # it had finished and was waiting for its batch to end
            if held is None:
                held = self.closing(req)
            return dataclasses.replace(held, finished=True, finish_reason=req.finish_reason, error=req.error)
        return merge_outputs(held, self._output(req, [], finish))

    def closing(self, req: Request) -> RequestOutput:
        """The final output of a finished request, whatever state its detokenizer is in."""
        self._states.pop(req.seq_id, None)
        self._held.pop(req.seq_id, None)
        return RequestOutput(req.request_id, req.prompt_token_ids, [], list(req.output_token_ids), "", "",
                             True, req.finish_reason, req.error, index=req.index,
                             logprobs=req.logprobs, cumulative_logprob=req.cumulative_logprob)
