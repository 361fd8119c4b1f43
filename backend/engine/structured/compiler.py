"""Constraints compiled to grammars for one engine's tokenizer, once per distinct constraint, off the
request path.

`ConstraintCompiler` belongs to an engine. `submit(spec)` returns a future of the compiled
constraint: done at once for a constraint in its bounded LRU cache (a refused one is remembered
too, so a hostile schema sent again costs nothing), else compiled by the process-wide pool of
worker processes (compile_pool.py) under the engine's `structured_outputs_compile_timeout_s`.
Requests that ask for the same new constraint while it compiles share its one future. The engine
keeps a request whose grammar compiles out of the scheduler until the future is done (waitlist.py):
it holds no KV block and blocks nobody.

xgrammar's `TokenizerInfo` is built from the checkpoint's own tokenizer (backend/text/tokenizer.py)
and the model's vocabulary size (the logits' width, which may exceed the tokenizer's) and EOS ids,
on a pool thread before the first compile; xgrammar (which imports torch and transformers) loads
there, never on the caller's thread.
"""
from __future__ import annotations

import threading
import uuid
from collections import OrderedDict
from concurrent.futures import Future
from typing import TYPE_CHECKING, Optional, Sequence

from backend.engine.structured.compile_pool import CompileFailed, CompileJob, CompilePool, shared_pool
from backend.core.structured import FIELD, CompiledConstraint, StructuredOutputs

if TYPE_CHECKING:
    from backend.core.sampling_params import SamplingParams
    from backend.core.request import Request
    from backend.sched.grammar import GrammarState
    from backend.text.tokenizer import Tokenizer

CACHE_SIZE = 128  # compiled grammars kept; a large schema's token-mask cache takes megabytes
DEFAULT_TIMEOUT_S = 5.0


class GrammarTokenizer:
    """What a compile needs of the engine's tokenizer: xgrammar's TokenizerInfo (built once, on the
    first call from a pool thread) and its JSON for the workers."""

    def __init__(self, tokenizer: Optional["Tokenizer"], vocab_size: int, stop_token_ids: Sequence[int]):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = [t for t in stop_token_ids if 0 <= t < vocab_size]
        self.key = uuid.uuid4().hex
        self._lock = threading.Lock()
        self._info = None
        self._json: Optional[bytes] = None

    def info(self):
        with self._lock:
            if self._info is None:
                if self.tokenizer is None:
                    raise CompileFailed(f"{FIELD} needs the model's tokenizer: this checkpoint has no tokenizer.json")
                import xgrammar as xgr
                from transformers import PreTrainedTokenizerFast

                # xgrammar reads the vocabulary and how its bytes are encoded (byte-level,
                # byte-fallback, raw) from a transformers fast tokenizer: ours wrapped, not loaded twice.
                self._info = xgr.TokenizerInfo.from_huggingface(
                    PreTrainedTokenizerFast(tokenizer_object=self.tokenizer.backend), vocab_size=self.vocab_size,
                    stop_token_ids=self.stop_token_ids or None)
                if not self.stop_token_ids:
                    self.stop_token_ids = list(self._info.stop_token_ids)
            return self._info

    def json(self) -> bytes:
        info = self.info()
        with self._lock:
            if self._json is None:
                self._json = info.serialize_json().encode("utf-8")
            return self._json


class ConstraintCompiler:
    def __init__(self, tokenizer: Optional["Tokenizer"], vocab_size: int, stop_token_ids: Sequence[int],
                 cache_size: int = CACHE_SIZE, timeout: float = DEFAULT_TIMEOUT_S,
                 pool: Optional[CompilePool] = None):
        self.tokenizer = GrammarTokenizer(tokenizer, vocab_size, stop_token_ids)
        self.vocab_size = vocab_size
        self.cache_size = cache_size
        self.timeout = timeout
        self.pool = pool
        self._cache: OrderedDict[tuple, Future] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    @property
    def stop_token_ids(self) -> list[int]:
        return self.tokenizer.stop_token_ids

    def submit(self, spec: StructuredOutputs) -> Future:
        """The compiled constraint's future: done already when the constraint is cached. Its
        exception is a ValueError naming the field (CompileFailed), or GrammarCompilerBusy."""
        key = spec.cache_key
        with self._lock:
            found = self._cache.get(key)
            if found is not None:
                self._cache.move_to_end(key)
                self.hits += 1
                return found
            self.misses += 1
            job = CompileJob(f"{FIELD}.{spec.kind}", spec.kind, spec.source, not spec.disable_any_whitespace,
                             self.tokenizer, self.timeout, lambda payload, allowed, completed, kind=spec.kind:
                             self._finish(kind, payload, allowed, completed))
            self._cache[key] = job.future
            if len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        job.future.add_done_callback(lambda f, key=key: self._forget_unless_refused(key, f))
        (self.pool or shared_pool()).submit(job)
        return job.future

    def compile(self, spec: StructuredOutputs, timeout: Optional[float] = None) -> CompiledConstraint:
        """Submit and wait (tools and benchmarks; the engine never waits)."""
        return self.submit(spec).result(timeout)

    def _forget_unless_refused(self, key: tuple, future: Future) -> None:
        """A refusal is kept (the same constraint is refused again at once); anything else that
        went wrong (a busy compiler, a cancelled job) may go better next time."""
        if future.cancelled() or (future.exception() is not None and not isinstance(future.exception(), CompileFailed)):
            with self._lock:
                if self._cache.get(key) is future:
                    del self._cache[key]

    def _finish(self, kind: str, payload: bytes, allowed: bool, completed: bool) -> CompiledConstraint:
        """On a pool thread: the worker's grammar, loaded for this process's matchers."""
        import xgrammar as xgr

        if not allowed and not completed:
            raise CompileFailed(f"{FIELD}.{kind}: no token of this model's vocabulary can start it (the tokenizer "
                                "cannot satisfy it)")
        grammar = xgr.CompiledGrammar.deserialize_json(payload.decode("utf-8"), self.tokenizer.info())
        return CompiledConstraint(grammar, kind, self.vocab_size, only_empty=completed and not allowed)

    def attach(self, request: "Request") -> None:
        """Submit the request's constraint: a cached one is attached now (request.grammar), a cached
        refusal raised now (a ValueError naming the field); a new one is left compiling
        (request.pending_grammar), for the engine's waitlist."""
        future = self.submit(request.params.structured_outputs)
        if not future.done():
            request.pending_grammar = future
            return
        refused = future.exception()
        if refused is not None:  # a copy: raising the cached exception again would grow its traceback
            raise type(refused)(*refused.args) from None
        request.grammar = self.new_state(future.result(), request.params)

    def new_state(self, compiled: CompiledConstraint, params: "SamplingParams") -> "GrammarState":
        """The matcher state of a request's first completion; ValueError for a constraint that
        cannot be used with these settings."""
        if compiled.only_empty and params.min_tokens > 0:
            raise CompileFailed(f"{FIELD}.{compiled.kind} admits only an empty output, but min_tokens is "
                                f"{params.min_tokens}")
        from backend.sched.grammar import GrammarState
        return GrammarState(compiled, self.stop_token_ids)

    def warm_up(self) -> Future:
        """Start a worker and build the tokenizer info now, in the background (else the first
        constrained request waits for them, outside its timeout): for callers that time compiles."""
        return self.submit(StructuredOutputs(regex="[a-z]"))
