"""The Triton ops keep the references' signatures (the engine calls either through dispatch)."""
import inspect
import os

import pytest
import torch

from kernels import dispatch, reference

NAMES = ["store_kv", "decode_attention", "prefill_attention", "rms_norm", "rotary_embedding", "silu_mul",
         "gelu_tanh_mul"]


@pytest.mark.parametrize("name", NAMES)
def test_signature_extends_reference(name):
    from kernels.gpu import triton_ops
    kw = inspect.Parameter.KEYWORD_ONLY
    ref = inspect.signature(getattr(reference, name)).parameters
    ours = inspect.signature(getattr(triton_ops, name)).parameters
    positional = lambda params: [(p.name, p.kind, p.default) for p in params.values() if p.kind is not kw]
    assert positional(ours) == positional(ref)
    for p in ours.values():  # keyword-only: the reference's hints, then tuning knobs; all optional
        if p.kind is kw:
            assert p.default is not inspect.Parameter.empty
            if p.name in ref:
                assert ref[p.name].kind is kw and ref[p.name].default == p.default
    assert all(p.name in ours for p in ref.values())


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                    reason="needs the interpreter or CUDA")
def test_dispatch_triton_backend_returns_the_kernels():
    from kernels.gpu import triton_ops
    ops = dispatch.get_ops("triton", torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    assert ops.name == "triton"
    for name in NAMES:
        assert getattr(ops, name) is getattr(triton_ops, name)
