"""quantization=fp8 rehearsed on the CPU (tests/fake_cuda.py: torch.cuda answers as an H200 or an
A100 would, the tensors stay on the CPU): the decoder's projections become FP8 matrices (e4m3 codes,
a float32 scale per output channel) while the embedding and lm_head keep the model's dtype, the
engine's log-probabilities stay close to the unquantized run, and a GPU without fp8 (sm_80) or a
CPU engine is refused by name. On a real GPU the same matrices run the Triton W8 GEMM
(kernels/gpu/quant_w8_gemm.py, its own interpreter tests)."""
import pytest
import torch
from torch import nn

from backend import LLM, SamplingParams
from backend.models.quant_linear import QuantLinear
from client.tools.quality.perplexity import window_logprobs
from fake_cuda import FakeCuda
from kernels.quant_formats import FP8_MAX

ON_GPU = dict(device="cuda:0", attention_backend="torch", enforce_eager=True,
              max_tokens_in_paged_kv_cache=1024, max_model_len=256)
PROJECTIONS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


def test_fp8_holds_the_projections_in_e4m3_and_stays_close(monkeypatch, tmp_path, default_model_dir):
    FakeCuda(capability=(9, 0)).install(monkeypatch)
    monkeypatch.setenv("INFLIGHT_LOCK_DIR", str(tmp_path))
    fp8 = LLM(str(default_model_dir), quantization="fp8", **ON_GPU)
    base = LLM(str(default_model_dir), quantization="none", **ON_GPU)
    model, reference = fp8.engine.runner.model, base.engine.runner.model
    assert fp8.engine.runner.weights.quantization == "fp8" and "fp8 (e4m3" in fp8.engine.runner.weights.summary
    for layer, ref_layer in zip(model.layers, reference.layers):
        for name in PROJECTIONS:
            q, w = layer.get_submodule(name), ref_layer.get_submodule(name).weight.detach().float()
            assert isinstance(q, QuantLinear) and q.qtype == "FP8", name
            assert q.parts["qweight"].dtype == torch.float8_e4m3fn and q.parts["scales"].shape == (w.shape[0], 1)
            # each row's scale maps its largest weight to e4m3's largest value; the codes round to it
            assert torch.allclose(q.parts["scales"][:, 0] * FP8_MAX, w.abs().amax(dim=1), rtol=1e-6)
            dequantized = q.rows(torch.arange(0))  # shape check of the row path
            assert dequantized.shape == (0, q.in_features)
            err = (q.parts["qweight"].float() * q.parts["scales"] - w).abs()
            assert float((err / w.abs().amax(dim=1, keepdim=True)).max()) <= 2 ** -4  # e4m3: 3 mantissa bits
    assert isinstance(model.lm_head, nn.Linear) and model.lm_head.weight.dtype == torch.bfloat16
    assert model.embed_tokens.weight.dtype == torch.bfloat16
    # fp8 holds the projections in a byte a weight where bf16 needs two
    assert fp8.engine.runner.weights.weight_bytes < 0.8 * base.engine.runner.weights.weight_bytes
    ids = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, model.cfg.vocab_size, (61,), generator=ids).tolist()
    gap = (window_logprobs(fp8, prompt) - window_logprobs(base, prompt)).abs()
    assert float(gap.mean()) < 0.5, float(gap.mean())  # random tiny models are touchy: a wrong scale moves it by several
    out = fp8.generate([prompt[:13], prompt[20:37]], SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True))
    assert [len(o.token_ids) for o in out] == [9, 9]


def test_fp8_is_refused_without_an_fp8_gpu(monkeypatch, tmp_path, default_model_dir):
    FakeCuda(capability=(8, 0)).install(monkeypatch)
    monkeypatch.setenv("INFLIGHT_LOCK_DIR", str(tmp_path))
    with pytest.raises(ValueError, match=r"quantization=fp8 needs compute capability 8.9 or newer .*cuda:0 has 8.0"):
        LLM(str(default_model_dir), quantization="fp8", **ON_GPU)
    with pytest.raises(ValueError, match="quantization=fp8 needs a CUDA GPU with fp8 support .* runs on cpu"):
        LLM(str(default_model_dir), quantization="fp8", device="cpu", cpu_kv_cache_tokens=512, max_model_len=256)


def test_an_fp8_kv_cache_holds_e4m3_at_half_the_bytes_and_stays_close(monkeypatch, tmp_path, default_model_dir):
    """kv_cache_dtype=fp8 on a (fake) H200: the cache tensors are e4m3, a block costs half of
    bf16's (so the same memory holds twice the tokens), and the log-probabilities stay close to
    the bf16 cache's. The Triton kernels that store and read it: tests/kernels/test_kernel_fp8_kv.py."""
    from backend.kv.sizing import kv_bytes_per_token

    FakeCuda(capability=(9, 0)).install(monkeypatch)
    monkeypatch.setenv("INFLIGHT_LOCK_DIR", str(tmp_path))
    fp8 = LLM(str(default_model_dir), kv_cache_dtype="fp8", **ON_GPU)
    base = LLM(str(default_model_dir), kv_cache_dtype="bfloat16", **ON_GPU)
    runner = fp8.engine.runner
    assert runner.kv_dtype == torch.float8_e4m3fn and runner.kv_caches[0][0].dtype == torch.float8_e4m3fn
    assert 2 * kv_bytes_per_token(runner.model_cfg, runner.kv_dtype) == kv_bytes_per_token(runner.model_cfg, torch.bfloat16)
    ids = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, runner.model_cfg.vocab_size, (61,), generator=ids).tolist()
    gap = (window_logprobs(fp8, prompt) - window_logprobs(base, prompt)).abs()
    assert 0 < float(gap.mean()) < 0.25, float(gap.mean())   # e4m3 keeps 3 mantissa bits of each K and V
    out = fp8.generate([prompt[:13], prompt[20:37]], SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True))
    assert [len(o.token_ids) for o in out] == [9, 9] and fp8.stats()["kv_blocks_used"] == 0


def test_an_fp8_kv_cache_is_refused_without_an_fp8_gpu(monkeypatch, tmp_path, default_model_dir):
    FakeCuda(capability=(8, 0)).install(monkeypatch)
    monkeypatch.setenv("INFLIGHT_LOCK_DIR", str(tmp_path))
    with pytest.raises(ValueError, match=r"kv_cache_dtype=fp8 needs compute capability 8.9 or newer .*cuda:0 has 8.0"):
        LLM(str(default_model_dir), kv_cache_dtype="fp8", **ON_GPU)
    with pytest.raises(ValueError, match=r"kv_cache_dtype=fp8_e4m3 needs a CUDA GPU with fp8 support .* runs on cpu"):
        LLM(str(default_model_dir), kv_cache_dtype="fp8_e4m3", device="cpu", cpu_kv_cache_tokens=512, max_model_len=256)
