"""Half-precision engines run on CPU (float32 activations; float_gemm.c reads the 16-bit weights)
and stay close to float32."""
import pytest
import torch

from backend import LLM, SamplingParams


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_agrees_with_float32_at_first(default_model_dir, dtype):
    prompt = "the scheduler admits requests"
    p = SamplingParams(max_tokens=8, temperature=0)
    ref = LLM(str(default_model_dir), dtype="float32").generate([prompt], p)[0].token_ids
    llm = LLM(str(default_model_dir), dtype=dtype)
    assert llm.engine.runner.dtype == getattr(torch, dtype)
    assert llm.engine.runner.kv_caches[0][0].dtype == torch.bfloat16  # the C attention's (none in float16)
    out = llm.generate([prompt], p)[0].token_ids
    # Rounding differences compound over steps; the first tokens must still agree.
    assert out[:3] == ref[:3]
    assert llm.stats()["kv_blocks_used"] == 0
