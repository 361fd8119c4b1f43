"""From sampled tokens to what callers see (vLLM's OutputProcessor pattern): incremental
detokenizing, stop strings, logprobs, and the building of every `RequestOutput`. The engine's step
ends by handing its results here; what the processor finds (a stop string that completed) it
returns to the engine, which finishes those requests in the scheduler."""
from __future__ import annotations

from typing import Optional

from backend.core.outputs import Logprob, RequestOutput, StopStringMatcher, TokenLogprobs
from backend.core.request import Request, RequestStatus
from backend.text.detokenizer import IncrementalDetokenizer
from backend.text.tokenizer import Tokenizer


class _State:
    """One sequence's text state; `seen`: its output tokens handled so far."""
    __slots__ = ("detok", "stops", "seen")

    def __init__(self, detok: Optional[IncrementalDetokenizer], stops: StopStringMatcher):
        self.detok, self.stops, self.seen = detok, stops, 0


class OutputProcessor:
    def __init__(self, tokenizer: Optional[Tokenizer]):
        self.tokenizer = tokenizer
        self._states: dict[str, _State] = {}

    def add(self, req: Request) -> None:
        detok = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids) if self.tokenizer else None
        self._states[req.seq_id] = _State(detok, StopStringMatcher(req.params.stop))

    # -- after a step ---------------------------------------------------------------------------
    def step_outputs(self, requests: list[Request], sampled: dict) -> tuple[list[RequestOutput], list[Request]]:
        """Outputs for the requests that sampled a token this step (`sampled`: seq_id -> Sampled),
        and the requests a stop string ended (the caller finishes them as FINISHED_STOPPED; their
        outputs already say so)."""
        results, stopped = [], []
        for req in requests:
            s = sampled.get(req.seq_id)
            if s is not None:
                # a verify row's tokens (its accepted drafts, then the last), as many as the
                # scheduler recorded: an EOS or a length limit may have ended it before the last
                tokens = s.tokens[:len(req.output_token_ids) - self._states[req.seq_id].seen]
                output, stop = self._output(req, [t.token for t in tokens],
                                            [self._logprobs(t) for t in tokens] if s.logprob is not None else None)
                results.append(output)
                if stop:
                    stopped.append(req)
        return results, stopped

    def _logprobs(self, s) -> TokenLogprobs:
        entries = {tok: Logprob(lp, rank + 1, self._piece(tok)) for rank, (tok, lp) in enumerate(s.top)}
        entries[s.token] = Logprob(s.logprob, s.rank, self._piece(s.token))
        return entries

    def _piece(self, token: int) -> str:
        return self.tokenizer.decode([token], skip_special_tokens=False) if self.tokenizer else ""

    def _output(self, req: Request, new_ids: list[int],
                new_logprobs: Optional[list[TokenLogprobs]] = None) -> tuple[RequestOutput, bool]:
        """Detokenize new tokens, apply stop strings, and package what the caller sees; True when a
        stop string ended the request here."""
        state = self._states[req.seq_id]
        if len(new_ids) > 1 and state.detok is not None and state.stops.stops:
            stop, new_ids, new_logprobs = self._stop_within(req, state, new_ids, new_logprobs)
        else:
            delta = ""
            if state.detok is not None:
                # vLLM v1: the EOS or stop token that ended a request is in its token ids, not its text
                text_ids = new_ids[:-1] if new_ids and req.stop_token_id is not None else new_ids
                delta = state.detok.add(text_ids) if text_ids else ""
                if req.status.finished:
                    delta += state.detok.flush()
            # vLLM checks stop strings only once more than min_tokens tokens were generated
            stop = state.stops.feed(delta, check=len(req.output_token_ids) > req.params.min_tokens)
        state.seen = len(req.output_token_ids)
        status = req.status
        if stop and (not status.finished or status is RequestStatus.FINISHED_LENGTH):
            status = RequestStatus.FINISHED_STOPPED  # also when it completed on the last allowed token
        else:
            stop = False
        if new_logprobs:
            req.logprobs.extend(new_logprobs)
            req.cumulative_logprob += sum(lp[t].logprob for lp, t in zip(new_logprobs, new_ids))
        if status.finished:
            del self._states[req.seq_id]
        new_text = state.stops.emit(final=status.finished)
        queued = None
        if len(req.output_token_ids) == len(new_ids) and new_ids and req.admitted_time is not None:
            queued = max(0.0, req.admitted_time - req.arrival_time)  # its first token: report the wait once
        return RequestOutput(req.request_id, req.prompt_token_ids, new_ids, list(req.output_token_ids),
                             new_text, state.stops.emitted, status.finished,
                             status.value if status.finished else None, req.error,
                             index=req.index, new_logprobs=new_logprobs,
                             logprobs=req.logprobs, cumulative_logprob=req.cumulative_logprob,
                             queue_seconds=queued, num_cached_tokens=req.num_cached_tokens), stop

    def _stop_within(self, req: Request, state: _State, new_ids: list[int],
                     new_logprobs: Optional[list[TokenLogprobs]]) -> tuple[bool, list[int], Optional[list]]:
        """Several tokens of one step (a verify row's): each is detokenized and checked for stop
        strings as if it came alone, and a stop string that completes before the last ends the
        output there: the tokens after it are dropped from the request (which the engine then
        finishes), so speculation never returns more than one-by-one decoding would."""
        before = len(req.output_token_ids) - len(new_ids)
        text_ids = new_ids[:-1] if req.stop_token_id is not None else new_ids
        for i, token in enumerate(text_ids):
            if state.stops.feed(state.detok.add([token]), check=before + i + 1 > req.params.min_tokens):
                if i + 1 < len(new_ids):
                    del req.output_token_ids[before + i + 1:]
                    req.stop_token_id = None  # the EOS after it (if any) is dropped with the rest
                return True, new_ids[:i + 1], new_logprobs[:i + 1] if new_logprobs else new_logprobs
        if req.status.finished:
            state.stops.feed(state.detok.flush(), check=len(req.output_token_ids) > req.params.min_tokens)
        return state.stops.stopped, new_ids, new_logprobs

    # -- requests that end outside a step --------------------------------------------------------
    def ended(self, req: Request) -> RequestOutput:
        """The final output of a request that was aborted or failed (already finished by the
        scheduler)."""
        if req.seq_id not in self._states:  # it had finished (and waited for its padded batch to end)
            return self.closing(req)
        return self._output(req, [])[0]

    def closing(self, req: Request) -> RequestOutput:
        """The final output of a finished request, whatever state its detokenizer is in."""
        self._states.pop(req.seq_id, None)
        return RequestOutput(req.request_id, req.prompt_token_ids, [], list(req.output_token_ids), "", "",
                             True, req.finish_reason, req.error, index=req.index,
                             logprobs=req.logprobs, cumulative_logprob=req.cumulative_logprob,
                             num_cached_tokens=req.num_cached_tokens, error_kind=req.error_kind)
