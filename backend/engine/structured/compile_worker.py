"""A grammar-compiling worker process: `python -m backend.engine.structured.compile_worker`.

It compiles one constraint at a time for the parent (compile_pool.py), reading requests from
stdin and writing results to stdout as frames (compile_pool.write_frame). A compile that runs past
its deadline is ended by the parent killing this process, which is why compiling happens here and
not on a thread of the server: xgrammar cannot be interrupted, and a schema may take minutes.

Frames in: {"op": "tokenizer", "key"} + xgrammar's TokenizerInfo JSON (once per tokenizer);
{"op": "compile", "key", "kind", "source", "any_whitespace", "vocab_size", "stop_token_ids"}.
Frames out: {"ready": true} once the imports are done; {"ok": true} per tokenizer; per compile {"ok": true, "allowed",
"completed"} + the CompiledGrammar's JSON, or {"ok": false, "error"}.
"""
from __future__ import annotations

import json
import os
import re
import sys
from typing import Any, Sequence

# xgrammar's C++ errors start with a time stamp and the source line: "[12:00:00] /x/y.cc:83: ..."
_CPP_PREFIX = re.compile(r"^\[[\d:]+\] \S+?:\d+: (Check failed: \(.*?\) is false: )?")
# xgrammar 0.2.8 writes a string with minLength/maxLength as characters `[^"\\\r\n]`: raw control
# characters (a tab, ESC) pass, and JSON forbids them (json.loads refuses the text). Its other strings
# exclude U+0000-U+001F; these get the same class.
_LENGTH_STRING_CHAR = r'[^\"\\\r\n]'
_JSON_STRING_CHAR = r'[^\0-\x1f\"\\]'


def build_grammar(compiler: Any, kind: str, source: str, any_whitespace: bool):
    """The constraint `source` of `kind` (backend/core/structured.py) compiled by `compiler` (an
    xgrammar.GrammarCompiler). Raises what xgrammar raises for a constraint it cannot compile."""
    import xgrammar as xgr

    if kind == "json":
        return compiler.compile_grammar(_json_schema_ebnf(source, any_whitespace))
    if kind == "json_object":  # any object: OpenAI's JSON mode
        return compiler.compile_grammar(_json_schema_ebnf('{"type": "object"}', any_whitespace, strict=False))
    if kind == "regex":
        return compiler.compile_regex(source)
    if kind == "choice":  # each choice a string literal of one EBNF rule; JSON's escapes are EBNF's
        return compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c, ensure_ascii=False)
                                                                 for c in json.loads(source)))
    if kind == "grammar":
        return compiler.compile_grammar(source) if "::=" in source else compiler.compile_lark(source)
    return compiler.compile_grammar(_json_strings_fixed(xgr.Grammar.from_structural_tag(source)))


def _json_schema_ebnf(schema: str, any_whitespace: bool, strict: bool = True) -> str:
    """The schema's grammar as EBNF, its string characters those JSON allows. strict: objects and
    arrays take no members the schema does not name (vLLM's xgrammar default)."""
    import xgrammar as xgr

    return _json_strings_fixed(xgr.Grammar.from_json_schema(schema, any_whitespace=any_whitespace, strict_mode=strict))


def _json_strings_fixed(grammar: Any) -> str:
    return str(grammar).replace(_LENGTH_STRING_CHAR, _JSON_STRING_CHAR)


def first_tokens(grammar: Any, vocab_size: int, stop_token_ids: Sequence[int]) -> tuple[bool, bool]:
    """(whether a token other than the stop tokens may come first, whether it may end at once)."""
    import xgrammar as xgr

    from backend.sched.grammar import allows_more_than, xgr_bitmask

    matcher = xgr.GrammarMatcher(grammar)
    bitmask = xgr_bitmask(1, vocab_size)
    matcher.fill_next_token_bitmask(bitmask, 0)
    return allows_more_than(bitmask[0], stop_token_ids), matcher.is_completed()


def reason(exc: BaseException) -> str:
    """xgrammar's message without its C++ time stamp and source line."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return _CPP_PREFIX.sub("", text)


def serve(inp, out) -> None:
    import xgrammar as xgr

    from backend.engine.structured.compile_pool import read_frame, write_frame

    compilers: dict[str, Any] = {}
    write_frame(out, {"ready": True})
    while True:
        frame = read_frame(inp)
        if frame is None:  # the parent closed the pipe (or died): nothing more to do
            return
        head, payload = frame
        if head["op"] == "tokenizer":
            info = xgr.TokenizerInfo.deserialize_json(payload.decode("utf-8"))
            # One compile at a time here; xgrammar's own threads fill the token-mask cache.
            compilers[head["key"]] = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
            write_frame(out, {"ok": True})
            continue
        try:
            grammar = build_grammar(compilers[head["key"]], head["kind"], head["source"], head["any_whitespace"])
            allowed, completed = first_tokens(grammar, head["vocab_size"], head["stop_token_ids"])
            write_frame(out, {"ok": True, "allowed": allowed, "completed": completed},
                        grammar.serialize_json().encode("utf-8"))
        except Exception as exc:  # xgrammar raises RuntimeError (and pydantic's) with the reason
            write_frame(out, {"ok": False, "error": reason(exc)})


def main() -> int:
    from backend.worker.parent_watch import exit_with_parent

    exit_with_parent()  # a killed server must not leave a compile running
    # The frames get stdout's pipe to themselves: anything a library prints goes to stderr instead.
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    serve(sys.stdin.buffer, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
