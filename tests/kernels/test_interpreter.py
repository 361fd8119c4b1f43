"""kernels/gpu/interpreter.py: under TRITON_INTERPRET=1 the interpreter's integer-overflow checks
are skipped, because with `debug` off (always, in the interpreter) Triton computes them and throws
the result away; with `debug` on they would fire, and then they are left on."""
import dataclasses
import os

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the CPU interpreter only")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.runtime import interpreter  # noqa: E402

import kernels.gpu  # noqa: E402,F401  (its import switches the checks off)
from kernels.gpu.interpreter import skip_discarded_overflow_checks  # noqa: E402


@triton.jit
def _square(x_ptr, out_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs)
    tl.store(out_ptr + offs, x * x)


def _run() -> torch.Tensor:
    x = torch.tensor([3, 70000, -5, 46341], dtype=torch.int32)   # 70000² and 46341² overflow int32
    out = torch.empty_like(x)
    _square[(1,)](x, out, BLOCK=4)
    return out


def _wrapped() -> list[int]:
    return (np.array([3, 70000, -5, 46341], dtype=np.int64) ** 2).astype(np.int32).tolist()


def test_importing_the_kernels_turns_the_discarded_checks_off():
    options = interpreter.interpreter_builder.options
    assert not options.debug and not options.sanitize_overflow


def test_with_debug_off_the_checks_were_computed_and_discarded(monkeypatch):
    """Triton's default (sanitize on, debug off): the overflow goes unreported, exactly as with the
    checks off; the results are the same int32 wrap-around."""
    builder = interpreter.interpreter_builder
    monkeypatch.setattr(builder, "options", dataclasses.replace(builder.options, sanitize_overflow=True))
    with_checks = _run().tolist()
    monkeypatch.setattr(builder, "options", dataclasses.replace(builder.options, sanitize_overflow=False))
    assert with_checks == _run().tolist() == _wrapped()


def test_with_debug_on_the_checks_fire_and_are_kept(monkeypatch):
    builder = interpreter.interpreter_builder
    monkeypatch.setattr(builder, "options", dataclasses.replace(builder.options, sanitize_overflow=True, debug=True))
    assert skip_discarded_overflow_checks() is False and builder.options.sanitize_overflow
    with pytest.raises(Exception, match="int32 overflow detected for operation mul"):
        _run()
    monkeypatch.setattr(builder, "options", dataclasses.replace(builder.options, debug=False))
    assert skip_discarded_overflow_checks() is True and not builder.options.sanitize_overflow
