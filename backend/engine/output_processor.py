"""From the engine thread's tokens to what callers see (vLLM's OutputProcessor, on the delivery side):
incremental detokenizing, stop strings, logprob texts, and the building of every `RequestOutput`.

The engine core steps on its own thread and hands out `CoreOutput`s (token ids and numbers, no text,
backend/core/outputs.py); this turns them into `RequestOutput`s wherever they are delivered: on the
caller's thread for `LLMEngine.step()` (the offline API), on the server's output thread for
`AsyncEngine`, so the engine thread never detokenizes. A stop string that completes ends the
sequence here at once (its output says `stop`, the tokens after it are dropped) and `process`
returns it, for the engine to finish in the scheduler at its next step; outputs the engine made for
it meanwhile are dropped here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from backend.core.outputs import CoreOutput, Logprob, RequestOutput, StopStringMatcher, TokenLogprobs
from backend.core.pooling import PoolingConfig, PoolingParams, finish_pooled
from backend.core.sampling_params import SamplingParams
from backend.core.request import Request
from backend.text.detokenizer import IncrementalDetokenizer
from backend.text.tokenizer import Tokenizer

StopMessage = tuple[str, int]  # (request id, completion index): a stop string ended it


@dataclass
class _Request:
    prompt_token_ids: list[int]
    params: SamplingParams
    open: int  # completions whose final output has not come
    pooling_params: Optional[PoolingParams] = None  # a pooling request's


class _Text:
    """One sequence's delivered text: its tokens, detokenizer, stop strings and logprobs so far."""
    __slots__ = ("detok", "stops", "token_ids", "logprobs", "cumulative", "done", "prompt_logprobs")

    def __init__(self, detok: Optional[IncrementalDetokenizer], stops: StopStringMatcher, logprobs: bool):
        self.detok, self.stops = detok, stops
        self.token_ids: list[int] = []
        self.logprobs: Optional[list[TokenLogprobs]] = [] if logprobs else None
        self.cumulative: Optional[float] = 0.0 if logprobs else None
        self.done = False  # its final output was made (a stop string may end it before the engine knows)
        self.prompt_logprobs: Optional[list] = None


class OutputProcessor:
    def __init__(self, tokenizer: Optional[Tokenizer]):
        self.tokenizer = tokenizer
        self._requests: dict[str, _Request] = {}
        self._texts: dict[tuple[str, int], _Text] = {}
        self.generation_tokens_total = 0  # tokens delivered (after stop strings)
        self.pooling: Optional[PoolingConfig] = None  # the pooling runner's (docs/pooling.md)
        self.pooling_requests_total = self.pooling_tokens_total = 0  # pooled requests and their prompt tokens

    def add(self, request: Request) -> None:
        """Follow a request (every completion of it) before the engine may output for it."""
        self._requests[request.request_id] = _Request(request.prompt_token_ids, request.params, request.params.n,
                                                      request.pooling_params)

    def process(self, outputs: list[CoreOutput]) -> tuple[list[RequestOutput], list[StopMessage]]:
        """The callers' outputs of the engine's, and the sequences a stop string ended."""
        results, stopped = [], []
        for o in outputs:
            key = (o.request_id, o.index)
            req = self._requests.get(o.request_id)
            text = self._texts.get(key)
            if text is None:
                if req is None:  # never followed (a refusal at the door): its output as it is
                    results.append(RequestOutput(o.request_id, [], [], [], "", "", o.finished, o.finish_reason,
                                                 o.error, index=o.index, error_kind=o.error_kind))
                    continue
                text = self._texts[key] = self._new_text(req)
            if text.done:  # ended by a stop string: the engine's outputs since then are dropped
                self._forget(key, o)
                continue
            result, stop = self._output(o, req, text)
            results.append(result)
            if stop and not o.finished:
                stopped.append(key)
            self._forget(key, o)
        return results, stopped

    def _new_text(self, req: _Request) -> _Text:
        p = req.params
        detok = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, p.skip_special_tokens,
                                       p.spaces_between_special_tokens) if self.tokenizer else None
        return _Text(detok, StopStringMatcher(p.stop, p.include_stop_str_in_output), p.logprobs is not None)

    def _forget(self, key: tuple[str, int], o: CoreOutput) -> None:
        """The engine's final output of a sequence: nothing more comes for it."""
        if not o.finished:
            return
        self._texts.pop(key, None)
        req = self._requests.get(o.request_id)
        if req is not None:
            req.open -= 1
            if req.open <= 0 or o.error_kind:  # (a refusal ends every completion at once)
                del self._requests[o.request_id]

    def _output(self, o: CoreOutput, req: _Request, text: _Text) -> tuple[RequestOutput, bool]:
        """Detokenize the new tokens, apply stop strings, and package what the caller sees; True
        when a stop string ended the sequence here."""
        new_ids = list(o.new_token_ids)
        new_logprobs = [self._logprobs(t, lp) for t, lp in zip(new_ids, o.new_logprobs)] if o.new_logprobs else None
        min_tokens = req.params.min_tokens
        before = len(text.token_ids)
        stop = False
        if text.detok is not None:
            # vLLM v1: the EOS or stop token that ended a request is in its token ids, not its text
            # (unless include_stop_str_in_output)
            cut = bool(new_ids) and o.stop_token_id is not None and not req.params.include_stop_str_in_output
            text_ids = new_ids[:-1] if cut else new_ids
            if len(new_ids) > 1 and text.stops.stops:
                # several tokens at once (a verify row's, a padded batch's): each is checked as if it
                # came alone; one that completes a stop string ends the output there
                for i, token in enumerate(text_ids):
                    if text.stops.feed(text.detok.add([token]), check=before + i + 1 > min_tokens):
                        new_ids = new_ids[:i + 1]
                        new_logprobs = new_logprobs[:i + 1] if new_logprobs else new_logprobs
                        stop = True
                        break
                if not stop and o.finished:
                    stop = text.stops.feed(text.detok.flush(), check=before + len(new_ids) > min_tokens)
            else:
                delta = text.detok.add(text_ids) if text_ids else ""
                if o.finished:
                    delta += text.detok.flush()
                # vLLM checks stop strings only once more than min_tokens tokens were generated
                stop = text.stops.feed(delta, check=before + len(new_ids) > min_tokens)
        finish = o.finish_reason
        if stop and finish in (None, "length", "stop"):
            finish = "stop"  # also when it completed on the last allowed token
        else:
            stop = False
        text.token_ids += new_ids
        self.generation_tokens_total += len(new_ids)
        if new_logprobs:
            text.logprobs.extend(new_logprobs)
            text.cumulative += sum(lp[t].logprob for lp, t in zip(new_logprobs, new_ids))
        finished = finish is not None
        text.done = finished
        if o.prompt_logprobs is not None or (text.prompt_logprobs is None and new_ids and req.params.prompt_logprobs
                                             is not None and o.index == 0):
            # vLLM's shape: None for the first prompt token (nothing before it), then a dict per token
            text.prompt_logprobs = [None] + [self._logprobs(t, raw) if raw else None for t, raw in
                                             zip(req.prompt_token_ids[1:], o.prompt_logprobs or [])]
        new_text = text.stops.emit(final=finished)
        pooled = None
        if o.pooled is not None:  # the engine side's part of pooling: Matryoshka cut, normalize, sigmoid
            pooled = finish_pooled(o.pooled, req.pooling_params, self.pooling)
            self.pooling_requests_total += 1
            self.pooling_tokens_total += len(req.prompt_token_ids)
        return RequestOutput(o.request_id, req.prompt_token_ids, new_ids, list(text.token_ids), new_text,
                             text.stops.emitted, finished, finish, o.error, index=o.index,
                             new_logprobs=new_logprobs, logprobs=text.logprobs, cumulative_logprob=text.cumulative,
                             queue_seconds=o.queue_seconds, queue=o.queue, num_cached_tokens=o.num_cached_tokens,
                             error_kind=o.error_kind, prompt_logprobs=text.prompt_logprobs, pooled=pooled), stop

    def _logprobs(self, token: int, raw: tuple[float, int, list]) -> TokenLogprobs:
        logprob, rank, top = raw
        entries = {tok: Logprob(lp, r + 1, self._piece(tok)) for r, (tok, lp) in enumerate(top)}
        entries[token] = Logprob(logprob, rank, self._piece(token))
        return entries

    def _piece(self, token: int) -> str:
        return self.tokenizer.decode([token], skip_special_tokens=False) if self.tokenizer else ""

    def __len__(self) -> int:
        return len(self._texts)
