"""The KV tiers in a real tritonserver: a prompt served before a restart is found on disk by the
first request after it (its KV blocks written when the server stopped), the request reports its
cached tokens through `num_cached_tokens`, the metrics port shows the disk tier's hits and fill,
and the answer is the in-process engine's."""
import json

import numpy as np

from .conftest import SERVER_PARAMS, requires_tritonserver, wait_until
from .raw_requests import array, grpc_stream
from .series import gauge as metric
from .series import names as series_names
from .test_deploy_live import PER_TIER_PREFIX, dashboard_metric_names

pytestmark = requires_tritonserver
PROMPT = [5 + (7 * i) % 200 for i in range(40)]  # 2 full blocks of 16 and 8 tokens
SAMPLING = json.dumps({"temperature": 0, "max_tokens": 4, "ignore_eos": True})


def ask(server, prompt):
    responses = grpc_stream(server.grpc_url, {"input_ids": np.array(prompt, dtype=np.int32),
                                              "sampling_parameters": array(SAMPLING),
                                              "return_num_cached_tokens": array(True)})
    (response,) = responses
    return response["output_ids"].tolist()[len(prompt):], int(response["num_cached_tokens"][0])


def test_the_first_request_after_a_restart_finds_its_prefix_on_disk(model_repository, model_path, llm, tmp_path):
    from backend import SamplingParams
    from serving.triton_launcher import TritonServer

    params = {**SERVER_PARAMS, "kv_host_cache_bytes": str(1 << 20), "kv_disk_cache_dir": str(tmp_path),
              "kv_disk_cache_bytes": str(64 << 20)}
    want = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0].token_ids
    with TritonServer(model_repository, params=params, model_path=str(model_path)) as server:
        assert ask(server, PROMPT) == (want, 0)  # nothing cached yet
        assert ask(server, PROMPT) == (want, 32)  # the device cache's two full blocks
    (folder,) = [p for p in tmp_path.iterdir() if p.is_dir()]  # (beside .lock, .secret, .usage)
    assert len(list(folder.glob("*.kv"))) >= 2  # written when the server stopped

    with TritonServer(model_repository, params=params, model_path=str(model_path)) as server:
        # every tier series exists with its value once the model is ready (the first report is
        # written in initialize): no wait here; waiting for one series' name once let the test read
        # another before it was made (a KeyError)
        assert metric(server, "inflight_kv_tier_blocks", tier="disk", state="used") >= 2
        assert ask(server, PROMPT) == (want, 32)  # the first request after the restart
        # counters are written by the metrics thread (every 0.1 s, or poked when a request starts
        # or ends), not before the response: wait for the request's hits, then check there are no more
        def disk_hits():
            return metric(server, "inflight_kv_tier_hits_total", tier="disk")
        wait_until(lambda: disk_hits() >= 2, timeout=5)
        assert disk_hits() == 2
        wait_until(lambda: metric(server, "inflight_kv_tier_bytes_total", tier="disk", direction="load") > 0,
                   timeout=5)
        # the gauges refresh every 0.1 s: the request's blocks are given back by then
        wait_until(lambda: metric(server, "inflight_kv_blocks", state="used") == 0, timeout=5)
        tier_panels = {n for n in dashboard_metric_names() if n.startswith(PER_TIER_PREFIX)}
        assert tier_panels and tier_panels <= series_names(server), sorted(tier_panels - series_names(server))
