"""Constraints compiled to grammars for one engine's tokenizer, once per distinct constraint.

`ConstraintCompiler` belongs to an engine. On the first constrained request it builds xgrammar's
`TokenizerInfo` from the checkpoint's own tokenizer (backend/text/tokenizer.py) and the model's vocabulary
size (the logits' width, which may exceed the tokenizer's) and EOS ids; every later request reuses
it. Each distinct constraint (its kind, text and options) is compiled once and kept in a bounded
LRU cache. Compiling happens in `LLMEngine.make_request`, on the caller's thread and before the
request is queued, so a constraint that does not compile, or that no token of the vocabulary can
start, is a ValueError naming the field at arrival, before the request holds any KV block.

xgrammar (which imports torch and transformers) loads on the first constrained request only.
"""
from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Optional, Sequence

from backend.structured.spec import FIELD, CompiledConstraint, StructuredOutputs

if TYPE_CHECKING:
    from backend.request import SamplingParams
    from backend.structured.matcher import GrammarState
    from backend.text.tokenizer import Tokenizer

CACHE_SIZE = 128  # compiled grammars kept; a large schema's token-mask cache takes megabytes
COMPILE_THREADS = 2
# xgrammar's C++ errors start with a time stamp and the source line: "[12:00:00] /x/y.cc:83: ..."
_CPP_PREFIX = re.compile(r"^\[[\d:]+\] \S+?:\d+: (Check failed: \(.*?\) is false: )?")


class ConstraintCompiler:
    def __init__(self, tokenizer: Optional["Tokenizer"], vocab_size: int, stop_token_ids: Sequence[int],
                 cache_size: int = CACHE_SIZE):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = [t for t in stop_token_ids if 0 <= t < vocab_size]
        self.cache_size = cache_size
        self._cache: OrderedDict[tuple, CompiledConstraint] = OrderedDict()
        self._lock = threading.Lock()  # the cache
        self._init_lock = threading.Lock()  # the tokenizer info, built once
        self._compiler = None  # xgrammar.GrammarCompiler, made on first use
        self.hits = self.misses = 0

    def new_state(self, params: "SamplingParams") -> Optional["GrammarState"]:
        """The matcher state of a request's first completion (None without a constraint); raises
        ValueError for a constraint that cannot be used."""
        spec = params.structured_outputs
        if spec is None:
            return None
        compiled = self.compile(spec)
        if compiled.only_empty and params.min_tokens > 0:
            raise ValueError(f"{FIELD}.{compiled.kind} admits only an empty output, but min_tokens is "
                             f"{params.min_tokens}")
        from backend.structured.matcher import GrammarState
        return GrammarState(compiled, self.stop_token_ids)

    def compile(self, spec: StructuredOutputs) -> CompiledConstraint:
        key = spec.cache_key
        with self._lock:
            found = self._cache.get(key)
            if found is not None:
                self._cache.move_to_end(key)
                self.hits += 1
                return found
            self.misses += 1
        # Outside the lock: a schema that takes long to compile holds up no other request's lookup
        # (two threads may compile the same new constraint once each; the second result is kept).
        compiled = self._compile(spec)
        with self._lock:
            self._cache[key] = compiled
            self._cache.move_to_end(key)
            if len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return compiled

    # -- with xgrammar ------------------------------------------------------------------------------
    def _xgr_compiler(self):
        with self._init_lock:
            return self._make_xgr_compiler()

    def _make_xgr_compiler(self):
        if self._compiler is None:
            if self.tokenizer is None:
                raise ValueError(f"{FIELD} needs the model's tokenizer: this checkpoint has no tokenizer.json")
            import xgrammar as xgr
            from transformers import PreTrainedTokenizerFast

            # xgrammar reads the vocabulary and how its bytes are encoded (byte-level, byte-fallback,
            # raw) from a transformers fast tokenizer: ours wrapped, not loaded a second time.
            info = xgr.TokenizerInfo.from_huggingface(PreTrainedTokenizerFast(tokenizer_object=self.tokenizer.backend),
                                                      vocab_size=self.vocab_size,
                                                      stop_token_ids=self.stop_token_ids or None)
            if not self.stop_token_ids:
                self.stop_token_ids = list(info.stop_token_ids)
            # Our LRU is the cache: xgrammar's own would grow without a bound beside it.
            self._compiler = xgr.GrammarCompiler(info, max_threads=COMPILE_THREADS, cache_enabled=False)
        return self._compiler

    def _compile(self, spec: StructuredOutputs) -> CompiledConstraint:
        import xgrammar as xgr

        compiler = self._xgr_compiler()
        kind, source = spec.kind, spec.source
        where = f"{FIELD}.{kind}"
        try:
            if kind == "json":
                grammar = compiler.compile_grammar(_json_schema_ebnf(source, not spec.disable_any_whitespace))
            elif kind == "json_object":  # any object: OpenAI's JSON mode
                grammar = compiler.compile_grammar(
                    _json_schema_ebnf('{"type": "object"}', not spec.disable_any_whitespace, strict=False))
            elif kind == "regex":
                grammar = compiler.compile_regex(source)
            elif kind == "choice":
                # each choice a string literal of one EBNF rule; JSON's escapes are EBNF's
                grammar = compiler.compile_grammar(
                    "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.choice))
            elif kind == "grammar":
                grammar = (compiler.compile_grammar(source) if "::=" in source else compiler.compile_lark(source))
            else:
                grammar = compiler.compile_grammar(_json_strings_fixed(xgr.Grammar.from_structural_tag(source)))
        except Exception as exc:  # xgrammar raises RuntimeError (and pydantic's) with the reason
            raise ValueError(f"{where}: cannot be compiled: {_reason(exc)}") from None
        allowed, completed = _first_tokens(grammar, self.vocab_size, self.stop_token_ids)
        if not allowed and not completed:
            raise ValueError(f"{where}: no token of this model's vocabulary can start it (the tokenizer "
                             "cannot satisfy it)")
        return CompiledConstraint(grammar, kind, self.vocab_size, only_empty=completed and not allowed)


# xgrammar 0.2.8 writes a string with minLength/maxLength as characters `[^"\\\r\n]`: raw control
# characters (a tab, ESC) pass, and JSON forbids them (json.loads refuses the text). Its other strings
# exclude U+0000-U+001F; these get the same class.
_LENGTH_STRING_CHAR = r'[^\"\\\r\n]'
_JSON_STRING_CHAR = r'[^\0-\x1f\"\\]'


def _json_schema_ebnf(schema: str, any_whitespace: bool, strict: bool = True) -> str:
    """The schema's grammar as EBNF, its string characters those JSON allows. strict: objects and
    arrays take no members the schema does not name (vLLM's xgrammar default;
    disable_additional_properties asks the same)."""
    import xgrammar as xgr

    return _json_strings_fixed(xgr.Grammar.from_json_schema(schema, any_whitespace=any_whitespace, strict_mode=strict))


def _json_strings_fixed(grammar) -> str:
    return str(grammar).replace(_LENGTH_STRING_CHAR, _JSON_STRING_CHAR)


def _first_tokens(grammar, vocab_size: int, stop_token_ids: Sequence[int]) -> tuple[bool, bool]:
    """(whether a token other than the stop tokens may come first, whether it may end at once)."""
    import xgrammar as xgr

    from backend.structured.matcher import allows_more_than, xgr_bitmask

    matcher = xgr.GrammarMatcher(grammar)
    bitmask = xgr_bitmask(1, vocab_size)
    matcher.fill_next_token_bitmask(bitmask, 0)
    return allows_more_than(bitmask[0], stop_token_ids), matcher.is_completed()


def _reason(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return _CPP_PREFIX.sub("", text)
