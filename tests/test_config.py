"""EngineConfig: config.pbtxt strings map to typed fields; bad keys and values name themselves."""
import pytest

from backend import EngineConfig


def test_from_params_parses_every_kind_of_value():
    cfg = EngineConfig.from_params({
        "model_path": "/m", "kv_block_size": "32", "kv_cache_free_gpu_mem_fraction": "0.5",
        "enable_chunked_context": "false", "batch_scheduler_policy": "max_utilization",
        "enable_kv_cache_reuse": "True", "executor_static_batch_size": "-1"})
    assert cfg.kv_block_size == 32 and cfg.kv_cache_free_gpu_mem_fraction == 0.5
    assert cfg.enable_chunked_context is False and cfg.enable_kv_cache_reuse is True
    assert cfg.batch_scheduler_policy == "max_utilization" and cfg.batching_mode == "inflight"


def test_static_batch_size_switches_to_static_batching():
    cfg = EngineConfig.from_params({"executor_static_batch_size": "16"})
    assert cfg.batching_mode == "static" and cfg.static_batch_size == 16


@pytest.mark.parametrize("params, words", [
    ({"max_num_seq": "8"}, ["unknown parameter 'max_num_seq'", "max_num_seqs"]),
    ({"kv_block_size": "sixteen"}, ["kv_block_size", "integer", "sixteen"]),
    ({"kv_block_size": "0"}, ["kv_block_size", "in [1, 1024]"]),
    ({"enable_chunked_context": "maybe"}, ["enable_chunked_context", "true or false"]),
    ({"batch_scheduler_policy": "fifo"}, ["batch_scheduler_policy", "guaranteed_no_evict", "max_utilization"]),
    ({"batching_mode": "continuous"}, ["batching_mode", "inflight", "dynamic", "static", "none"]),
    ({"kv_cache_free_gpu_mem_fraction": "1.5"}, ["kv_cache_free_gpu_mem_fraction", "(0, 1)"]),
    # 1.0 would hand the whole free memory to the cache: no room for CUDA graphs or fragmentation
    ({"kv_cache_free_gpu_mem_fraction": "1.0"}, ["kv_cache_free_gpu_mem_fraction", "(0, 1)", "headroom"]),
    ({"enforce_eager": "sometimes"}, ["enforce_eager", "true or false"]),
    ({"attention_backend": "flash"}, ["attention_backend", "auto", "triton", "torch"]),
    ({"device": "tpu"}, ["device", "cuda:N"]),
    ({"executor_static_batch_size": "0"}, ["executor_static_batch_size", "-1"]),
])
def test_bad_parameters_are_refused_with_key_and_allowed_values(params, words):
    with pytest.raises(ValueError) as err:
        EngineConfig.from_params(params)
    for word in words:
        assert word in str(err.value)
