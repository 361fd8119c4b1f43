"""openai_server/metrics.py without a server: Triton's exposition of two engine instances summed into
one pod's protocol figures, rendered under our names and vLLM's (the live check, against the truth,
is tests/e2e/test_gateway_metrics.py)."""
import pytest

from openai_server.metrics import MetricsUnavailable, aggregate, default_metrics_url, parse_exposition, render

TRITON = '''# HELP inflight_num_requests_running Requests in the running batch
# TYPE inflight_num_requests_running gauge
inflight_num_requests_running{device="cpu",instance="llm_0_0",model="llm",version="1"} 2
inflight_num_requests_running{device="cpu",instance="llm_0_1",model="llm",version="1"} 1
inflight_num_requests_waiting{device="cpu",instance="llm_0_0",model="llm",version="1"} 3
inflight_num_requests_waiting{device="cpu",instance="llm_0_1",model="llm",version="1"} 1
inflight_kv_blocks{device="cpu",instance="llm_0_0",model="llm",state="used",version="1"} 30
inflight_kv_blocks{device="cpu",instance="llm_0_1",model="llm",state="used",version="1"} 10
inflight_kv_blocks{device="cpu",instance="llm_0_0",model="llm",state="total",version="1"} 100
inflight_kv_blocks{device="cpu",instance="llm_0_1",model="llm",state="total",version="1"} 300
inflight_kv_blocks{device="cpu",instance="llm_0_0",model="llm",state="free",version="1"} 70
inflight_kv_blocks{device="cpu",instance="llm_0_1",model="llm",state="free",version="1"} 290
inflight_kv_cache_usage_ratio{device="cpu",instance="llm_0_0",model="llm",version="1"} 0.3
inflight_cache_config_info{block_size="16",device="cpu",instance="llm_0_0",model="llm",num_gpu_blocks="100",version="1"} 1
inflight_cache_config_info{block_size="16",device="cpu",instance="llm_0_1",model="llm",num_gpu_blocks="300",version="1"} 1
inflight_lora_requests_info{instance="llm_0_0",max_lora="2",model="llm",running_lora_adapters="",waiting_lora_adapters="",version="1"} 1700000000.5
inflight_lora_requests_info{instance="llm_0_0",max_lora="2",model="llm",running_lora_adapters="sql,poet",waiting_lora_adapters="chef",version="1"} 1700000009.25
inflight_lora_requests_info{instance="llm_0_1",max_lora="2",model="llm",running_lora_adapters="poet",waiting_lora_adapters="",version="1"} 1700000003
inflight_num_requests_running{device="cpu",instance="other_0_0",model="other",version="1"} 7
nv_inference_request_success{model="llm",version="1"} 12
'''


def test_two_instances_sum_into_one_pods_figures():
    pod = aggregate(parse_exposition(TRITON), "llm")
    assert (pod.instances, pod.running, pod.waiting) == (2, 3, 4)            # the other model is left out
    assert (pod.blocks_used, pod.blocks_total) == (40, 400)
    assert pod.usage == 0.1                                                  # 40/400, not the mean of 0.3 and 1/30
    assert (pod.block_size, pod.blocks["num_gpu_blocks"]) == ("16", 400)
    assert pod.lora == {"max_lora": 4, "running": ["sql", "poet"], "waiting": ["chef"],   # each instance's newest
                        "updated": 1700000009.25}


def test_rendered_under_our_names_and_vllms_and_read_back():
    text = render(aggregate(parse_exposition(TRITON), "llm"), "my-model")
    got = {(s.name, tuple(sorted(s.labels.items()))): s.value for s in parse_exposition(text)}
    for ours, vllms, value in (("inflight_num_requests_running", "vllm:num_requests_running", 3),
                               ("inflight_num_requests_waiting", "vllm:num_requests_waiting", 4),
                               ("inflight_kv_cache_usage_ratio", "vllm:kv_cache_usage_perc", 0.1)):
        assert got[(ours, (("model_name", "my-model"),))] == got[(vllms, (("model_name", "my-model"),))] == value
    lora = (("max_lora", "4"), ("model_name", "my-model"), ("running_lora_adapters", "sql,poet"),
            ("waiting_lora_adapters", "chef"))
    assert got[("vllm:lora_requests_info", lora)] == got[("inflight_lora_requests_info", lora)] == 1700000009.25
    cache = (("block_size", "16"), ("model_name", "my-model"), ("num_gpu_blocks", "400"))
    assert got[("vllm:cache_config_info", cache)] == 1
    assert "# TYPE vllm:num_requests_waiting gauge" in text


def test_no_series_for_the_model_is_an_error_not_zeros():
    with pytest.raises(MetricsUnavailable, match="no inflight_\\* series for model 'llm'"):
        aggregate(parse_exposition('nv_inference_count{model="llm"} 3\n'), "llm")
    pod = aggregate(parse_exposition(TRITON.replace("inflight_lora_requests_info", "x")), "llm")
    assert pod.lora is None and "lora_requests_info" not in render(pod, "llm")   # no LoRA, no series (vLLM's)


def test_the_metrics_url_defaults_to_port_8002_of_the_grpc_host():
    assert default_metrics_url("localhost:8001") == "http://localhost:8002/metrics"
    assert default_metrics_url("10.1.2.3:9001") == "http://10.1.2.3:8002/metrics"
