"""Triton's CPU interpreter (TRITON_INTERPRET=1) without the integer-overflow checks it computes and
then throws away.

With `sanitize_overflow` on (the interpreter's default), every integer `+`, `-` and `*` in a kernel
is computed a second time in int64 and compared with the type's bounds, and the result goes to
`device_assert`, which returns without looking at it unless `debug` is on
(triton/language/semantic.py: `if not self.builder.options.debug: return`); the interpreter's
options never turn `debug` on. On the tests' tiny engines that dead work was a third of every
interpreted step. `skip_discarded_overflow_checks` switches it off, only where `debug` is off, so
nothing a kernel computes or checks changes; a GPU compile is not touched (its options are the
compiler's own, per launch). Nothing happens when triton is not installed or has no interpreter
builder. kernels/gpu/__init__.py calls it when TRITON_INTERPRET=1; tests/kernels/test_interpreter.py
shows the checks were discarded and are now skipped.
"""
from __future__ import annotations

import dataclasses


def skip_discarded_overflow_checks() -> bool:
    """Turn the interpreter's overflow checks off if their result is discarded (debug off); True if
    they are off afterwards."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    builder = getattr(interpreter, "interpreter_builder", None)
    options = getattr(builder, "options", None)
    if options is None or not hasattr(options, "sanitize_overflow") or getattr(options, "debug", True):
        return False
    if options.sanitize_overflow:
        builder.options = dataclasses.replace(options, sanitize_overflow=False)
    return True
