"""A draft model's KV cache and weights share the target's memory budget (backend/kv/sizing.py and backend/worker/memory.py,
backend/kv/sizing.py): sized one after the other, the target took 90% and the draft's cache did
not fit in what was left. Checked with the real shapes of two published pairs on a simulated H200
(141 GB), and through the engine on a fake GPU (tests/fake_cuda.py), where the two runners' caches
and the draft's weights must fit the budget together."""
import json

import pytest
import torch

from backend.kv.sizing import CacheShare, GpuMemory, blocks_that_fit, kv_bytes_per_token
from backend.models.loader import load_model_config
from backend.worker import memory
from backend.worker.memory import checkpoint_bytes, draft_cache_share
from fake_cuda import GIB, MIB, FakeCuda, FakeGpu

H200 = 141 * 10**9
FRACTION, BLOCK = 0.9, 16


def _write_config(tmp_path, name, config_class, **dims):
    path = tmp_path / name
    architecture = {"Qwen2Config": "Qwen2ForCausalLM", "LlamaConfig": "LlamaForCausalLM"}[config_class.__name__]
    config_class(architectures=[architecture], **dims).save_pretrained(path)   # transformers' own config.json
    return load_model_config(path)


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """(target config, target parameters, draft config, draft parameters): the config.json fields
    and parameter counts of the public checkpoints on the Hugging Face Hub."""
    from transformers import LlamaConfig, Qwen2Config

    tmp = tmp_path_factory.mktemp("pairs")
    qwen = dict(vocab_size=152064, rope_theta=1e6, max_position_embeddings=32768)
    llama = dict(vocab_size=128256, rope_theta=5e5, max_position_embeddings=131072)
    return {
        "Qwen2.5-0.5B for Qwen2.5-7B": (
            _write_config(tmp, "q7", Qwen2Config, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                          num_attention_heads=28, num_key_value_heads=4, **qwen), 7.62e9,
            _write_config(tmp, "q05", Qwen2Config, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                          num_attention_heads=14, num_key_value_heads=2, **dict(qwen, vocab_size=151936)), 0.494e9),
        "Llama-3.2-1B for Llama-3.1-8B": (
            _write_config(tmp, "l8", LlamaConfig, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                          num_attention_heads=32, num_key_value_heads=8, **llama), 8.03e9,
            _write_config(tmp, "l1", LlamaConfig, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                          num_attention_heads=32, num_key_value_heads=8, head_dim=64, **llama), 1.24e9),
    }


@pytest.mark.parametrize("pair", ["Qwen2.5-0.5B for Qwen2.5-7B", "Llama-3.2-1B for Llama-3.1-8B"])
def test_target_and_draft_fit_one_budget_on_an_h200(pairs, pair):
    target, target_params, draft, draft_params = pairs[pair]
    bf16 = torch.bfloat16
    t_tok, d_tok = kv_bytes_per_token(target, bf16), kv_bytes_per_token(draft, bf16)
    assert (t_tok, d_tok) == {"Qwen2.5-0.5B for Qwen2.5-7B": (57344, 12288),
                              "Llama-3.2-1B for Llama-3.1-8B": (131072, 32768)}[pair]
    # the device after the target's weights (bf16) and the CUDA context; the largest step's activations
    mem = GpuMemory(free=H200 - int(2 * target_params) - GIB, total=H200, activation=3 * GIB)
    budget = FRACTION * (mem.free - mem.activation)
    draft_weights = int(2 * draft_params)
    share = CacheShare(bytes_per_token=d_tok, reserved_bytes=draft_weights)
    blocks = blocks_that_fit(mem, FRACTION, BLOCK * t_tok, "cuda:0", share, BLOCK)
    tokens = blocks * BLOCK
    together = tokens * t_tok + tokens * d_tok + draft_weights   # both caches hold the same tokens
    assert budget - BLOCK * (t_tok + d_tok) < together <= budget
    # sized one after the other (the old rule), the draft's cache and weights outgrew the headroom
    alone = blocks_that_fit(mem, FRACTION, BLOCK * t_tok, "cuda:0")
    assert alone * BLOCK * d_tok + draft_weights > (1 - FRACTION) * (mem.free - mem.activation)
    # a fixed draft cache (draft_kv_cache_tokens) comes off the budget whole
    fixed = CacheShare(bytes_per_token=d_tok, reserved_bytes=draft_weights, fixed_tokens=100_000)
    fixed_blocks = blocks_that_fit(mem, FRACTION, BLOCK * t_tok, "cuda:0", fixed, BLOCK)
    assert fixed_blocks == int(budget - draft_weights - 100_000 * d_tok) // (BLOCK * t_tok)


def test_checkpoint_bytes_reads_the_headers_in_the_dtype_the_draft_runs(tmp_path):
    from safetensors.torch import load_file

    from backend.models.make_model import make_model

    model = make_model(tmp_path / "m", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2)
    numel = sum(t.numel() for t in load_file(str(model / "model.safetensors")).values())
    assert checkpoint_bytes(str(model), 2) == 2 * numel and checkpoint_bytes(str(model), 4) == 4 * numel


def test_the_engine_sizes_target_and_draft_from_one_budget(monkeypatch, tmp_path):
    """The real engine on a fake GPU with 40 MiB free: the target's cache, the draft's (the same
    tokens) and the draft's weights together stay within the fraction of free minus activations."""
    from backend import LLM
    from backend.models.make_model import make_model

    shape = dict(intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
    target = make_model(tmp_path / "target", hidden_size=128, num_hidden_layers=3, **shape)
    draft = make_model(tmp_path / "draft", seed=1, hidden_size=64, num_hidden_layers=1, **shape)
    gpu = FakeGpu(total=GIB, free=40 * MIB, allocated=8 * MIB, activation=4 * MIB)
    FakeCuda(gpus=[gpu]).install(monkeypatch)
    monkeypatch.setenv("INFLIGHT_LOCK_DIR", str(tmp_path))
    spec = json.dumps({"model": str(draft), "num_speculative_tokens": 2})
    llm = LLM(str(target), device="cuda:0", attention_backend="torch", enforce_eager=True, max_num_seqs=4,
              max_num_batched_tokens=64, max_model_len=256, kv_cache_free_gpu_mem_fraction=FRACTION,
              speculative_config=spec)
    runner, draft_runner = llm.engine.runner, llm.engine.speculator.proposer.runner
    t_block = BLOCK * kv_bytes_per_token(load_model_config(target), runner.kv_dtype)
    d_block = BLOCK * kv_bytes_per_token(load_model_config(draft), draft_runner.kv_dtype)
    share = draft_cache_share(llm.engine.config, torch.device("cuda", 0), runner.kv_dtype)
    assert share.reserved_bytes == checkpoint_bytes(str(draft), runner.dtype.itemsize) > 0
    assert draft_runner.num_blocks == runner.num_blocks        # the same tokens, block for block
    budget = FRACTION * (gpu.free - gpu.activation)
    used = runner.num_blocks * (t_block + d_block) + share.reserved_bytes
    assert budget - (t_block + d_block) < used <= budget
    alone = int(budget) // t_block                             # what the target took before
    assert runner.num_blocks < alone
    out = llm.generate([[5, 6, 7, 8, 9]], None)
    assert out[0].token_ids
    assert memory.lock_path("GPU-fake-0").exists()
