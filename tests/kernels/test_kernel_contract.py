"""The Triton ops keep the references' signatures (the engine calls either through dispatch)."""
import inspect
import os

import pytest
import torch

from kernels import dispatch, reference

NAMES = ["store_kv", "decode_attention", "prefill_attention", "rms_norm", "rotary_embedding", "silu_mul"]


@pytest.mark.parametrize("name", NAMES)
def test_signature_extends_reference(name):
    from kernels import triton_ops
    ref = list(inspect.signature(getattr(reference, name)).parameters.values())
    ours = list(inspect.signature(getattr(triton_ops, name)).parameters.values())
    assert [(p.name, p.kind, p.default) for p in ours[:len(ref)]] == \
           [(p.name, p.kind, p.default) for p in ref]
    for extra in ours[len(ref):]:   # tuning knobs only: keyword-only, optional
        assert extra.kind is inspect.Parameter.KEYWORD_ONLY and extra.default is not inspect.Parameter.empty


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                    reason="needs the interpreter or CUDA")
def test_dispatch_triton_backend_returns_the_kernels():
    from kernels import triton_ops
    ops = dispatch.get_ops("triton", torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    assert ops.name == "triton"
    for name in NAMES:
        assert getattr(ops, name) is getattr(triton_ops, name)
