"""The inference gateway's model-server protocol on the OpenAI port's /metrics (docs/gateway.md),
scraped while requests queue on a real tritonserver with two engine instances (`count: 2`), one
slot each (max_num_seqs 1) and LoRA on (two adapters, max_loras 1):

- idle, loaded, and after the requests are cancelled, every protocol metric equals the truth: the
  requests the client has in flight (running: those that have streamed a token; queued: the rest),
  KV utilisation = the blocks those running requests hold (their prompt and tokens so far) over the
  two caches' blocks, the LoRA labels name the adapters in flight as running or waiting;
- our names and vLLM's carry the same values, and each equals the sum over Triton's per-instance
  series (its metrics port) at the same frozen moment (the fault injector's `stall` holds the
  engines still while both ports are read);
- Triton's port carries inflight_cache_config_info and inflight_lora_requests_info per instance;
- when Triton's metrics port does not answer, the scrape fails with 503 saying so.
"""
from __future__ import annotations

import os
import threading
import urllib.error

import pytest

from serving.openai_launcher import OpenAIServer
from openai_server.metrics import MetricsUnavailable, aggregate
from templates.exposition import read_page

from .conftest import cpu_repository, requires_tritonserver, wait_until

pytestmark = requires_tritonserver
openai = pytest.importorskip("openai")

BS = 16
KV_TOKENS = 8192                 # per instance: one request of MAX_TOKENS fits
BLOCKS = 2 * KV_TOKENS // BS     # both caches
PROMPT_LEN = 37                  # not a block multiple
# tens of seconds of decoding: as a rule nothing finishes before a scrape sees all five in the engines,
# even on a loaded host whose Triton metrics port answers the gateway late (503s) for tens of seconds
MAX_TOKENS = 4000
MAX_MODEL_LEN = 4096             # what the test model supports
ADAPTERS = [None, "sql", None, "poet", None]   # five requests for two slots


@pytest.fixture(scope="module")
def gateway(tmp_path_factory, model_path):
    """tritonserver (two instances, fault injection armed) and the OpenAI server beside it."""
    from serving.triton_launcher import TritonServer
    from lora_adapters import AdapterSpec, checkpoint_with_adapters

    root = tmp_path_factory.mktemp("gateway")
    folder, _ = checkpoint_with_adapters(model_path, root, ("sql", "poet"), seed=5, spec=AdapterSpec(r=4, alpha=8))
    repo = root / "repo"
    cpu_repository(repo, count=2)
    params = {"max_num_seqs": "1", "max_model_len": str(MAX_MODEL_LEN), "cpu_kv_cache_tokens": str(KV_TOKENS),
              "kv_block_size": str(BS), "enable_lora": "true", "max_loras": "1"}
    fault = root / "fault"
    env = dict(os.environ, INFLIGHT_FAULT_INJECTION="1", INFLIGHT_FAULT_FILE=str(fault))
    with TritonServer(repo, params=params, model_path=str(folder), env=env) as triton:
        with OpenAIServer(triton.grpc_url, folder, metrics_url=triton.metrics_url) as api:
            yield triton, api, fault


def scrape(url: str) -> dict:
    """{(name, frozenset(labels without model_name)): value} of the inflight_* and vllm:* series."""
    return {(s.name, frozenset((k, v) for k, v in s.labels.items() if k != "model_name")): s.value
            for s in read_page(url, timeout=10) if s.name.startswith(("inflight_", "vllm:"))}


def protocol_or_none(url: str):
    """The gateway's protocol figures, or None where no answer came in time: its scrape of Triton's
    port timed out (503), or the gateway itself did not answer within the scrape's 10 s. A starved
    host's metrics port answers late for a moment (seen right after the cancellations, with two busy
    processes beside the two tests), and so does the gateway's own event loop while it relays five
    streams on a fraction of a core (a scrape of 11-13 s, reproduced beside three CPU burners, the
    gateway's other scrapes 0.02-5 s); a poll tries again."""
    try:
        return protocol(scrape(url))
    except urllib.error.HTTPError as e:
        if e.code != 503:
            raise
        return None
    except TimeoutError:  # (socket.timeout) the gateway's answer did not come within the scrape's timeout
        return None
    except urllib.error.URLError as e:
        if not isinstance(e.reason, TimeoutError):
            raise
        return None


def value(series: dict, name: str, **labels) -> float:
    (found,) = [v for (n, ls), v in series.items() if n == name and all((k, x) in ls for k, x in labels.items())]
    return found


def info(series: dict, name: str) -> dict:
    (labels,) = [dict(ls) for (n, ls), _ in series.items() if n == name]
    return labels


def protocol(series: dict) -> dict:
    """The protocol's figures under our names, checked equal to vLLM's."""
    pairs = {"running": ("inflight_num_requests_running", "vllm:num_requests_running"),
             "waiting": ("inflight_num_requests_waiting", "vllm:num_requests_waiting"),
             "usage": ("inflight_kv_cache_usage_ratio", "vllm:kv_cache_usage_perc")}
    out = {}
    for key, (ours, vllms) in pairs.items():
        out[key] = value(series, ours)
        assert value(series, vllms) == out[key], key
    for ours, vllms in (("inflight_cache_config_info", "vllm:cache_config_info"),
                        ("inflight_lora_requests_info", "vllm:lora_requests_info")):
        assert info(series, ours) == info(series, vllms)
    out["used"], out["total"] = value(series, "inflight_kv_blocks", state="used"), value(series, "inflight_kv_blocks", state="total")
    out["cache"], out["lora"] = info(series, "inflight_cache_config_info"), info(series, "inflight_lora_requests_info")
    out["instances"] = value(series, "inflight_model_instances")
    return out


def lists(lora: dict) -> tuple[set, set]:
    return ({a for a in lora["running_lora_adapters"].split(",") if a},
            {a for a in lora["waiting_lora_adapters"].split(",") if a})


def test_the_protocol_metrics_follow_the_queue(gateway):
    triton, api, fault = gateway
    url = f"{api.url}/metrics"
    idle = protocol(scrape(url))
    assert (idle["running"], idle["waiting"], idle["used"], idle["usage"]) == (0, 0, 0, 0)
    assert idle["total"] == BLOCKS and idle["instances"] == 2
    assert idle["cache"] == {"block_size": str(BS), "num_gpu_blocks": str(BLOCKS)}
    assert idle["lora"]["max_lora"] == "2" and lists(idle["lora"]) == (set(), set())

    client = openai.OpenAI(base_url=f"{api.url}/v1", api_key="none", max_retries=0)
    received, finished = [0] * len(ADAPTERS), [False] * len(ADAPTERS)
    streams, closed = [], threading.Event()

    def send(i, adapter):
        """One streamed completion (the server answers its headers with the first token, so each
        runs on a thread of its own), counting the tokens that arrive (logprobs=0 lists them)."""
        prompt = [5 + (7 * i + j) % 1900 for j in range(PROMPT_LEN)]
        try:
            stream = client.completions.create(model=adapter or "llm", prompt=prompt, max_tokens=MAX_TOKENS,
                                               stream=True, temperature=0, logprobs=0, extra_body={"ignore_eos": True})
            streams.append(stream)
            for chunk in stream:
                received[i] += len(chunk.choices[0].logprobs.tokens) if chunk.choices[0].logprobs else 0
            finished[i] = True
        except Exception:
            if not closed.is_set():
                raise

    threads = [threading.Thread(target=send, args=(i, a), daemon=True) for i, a in enumerate(ADAPTERS)]
    for t in threads:
        t.start()
    try:
        # all five in the engines: one running per instance that has any, the others queued
        seen = []  # (running, waiting, tokens received per request) as they changed, for a failure's message

        def all_in():
            """Read on Triton's own port (the gateway's /metrics, on the event loop that relays the five
            streams, once answered late through the whole window: 2 of 2 polls timed out, 3 requests
            done by the third); the gateway's figures are checked below, once the engines are held."""
            try:
                p = aggregate(read_page(triton.metrics_url, timeout=10), "llm")
            except (OSError, MetricsUnavailable):  # (urllib's errors and timeouts are OSErrors)
                seen.append(("no answer",))
                return False
            now = (p.running, p.waiting, tuple(received))
            if not seen or seen[-1][:2] != now[:2]:
                seen.append(now)
            # every request not yet finished is in the engines, and some wait: all five, or, on a host
            # where the gateway's loop relaying the first streams passed the last requests on late (a
            # clean-clone run: three had ended, one ran and one waited, before the last two reached
            # Triton), the rest of them; the checks below count the ended ones
            return p.running + p.waiting == len(ADAPTERS) - sum(finished) and p.waiting >= 1
        try:
            wait_until(all_in, timeout=60, interval=0.05)
        except AssertionError:
            raise AssertionError(f"never all {len(ADAPTERS)} in the engines; (running, waiting, received) in "
                                 f"turn: {seen[-20:]}; finished: {finished}") from None
        fault.write_text("stall")                       # hold both engines still
        frozen = wait_until(lambda: _settled(lambda: _gauges(triton.metrics_url)), timeout=30)[0]
        loaded = wait_until(lambda: protocol_or_none(url), timeout=60)  # (the engines held: the same figures)
        # the truth, from the client: the running requests are those that have streamed tokens and
        # not ended, once every token the frozen engines made has arrived (a fast CPU decodes the tiny
        # model's MAX_TOKENS in ~4 s: a request may end, and the next start, before the stall)
        wait_until(lambda: _settled(lambda: list(received)), timeout=30)
        running = [i for i, n in enumerate(received) if n and not finished[i]]
        ended = [i for i in range(len(ADAPTERS)) if finished[i]]
        # one slot per instance: two run when Triton gave each instance some of the five, one when
        # it gave them all to one (its choice: execute() returns at once, so either is free again)
        assert 1 <= len(running) <= 2 and loaded["running"] == len(running), (received, finished, loaded)
        assert loaded["waiting"] == len(ADAPTERS) - len(running) - len(ended)
        held = sum(-(-(PROMPT_LEN + received[i] - 1) // BS) for i in running)            # blocks they hold
        assert loaded["used"] == held and loaded["total"] == BLOCKS
        assert loaded["usage"] == pytest.approx(held / BLOCKS, abs=1e-12)
        run_set, wait_set = lists(loaded["lora"])
        assert run_set == {ADAPTERS[i] for i in running} - {None}
        assert wait_set == {a for i, a in enumerate(ADAPTERS) if i not in running and i not in ended} - {None}
        if not ended:
            assert run_set | wait_set == {"sql", "poet"}                                # two adapters in flight
        # the OpenAI port's figures are Triton's per-instance series summed, at the same moment
        per_instance = aggregate(frozen, "llm")
        assert (per_instance.running, per_instance.waiting, per_instance.blocks_used) == \
               (loaded["running"], loaded["waiting"], loaded["used"])
        assert float(loaded["lora"]["max_lora"]) == 2 and per_instance.instances == 2
    finally:
        closed.set()
        for stream in list(streams):
            stream.close()                              # the client leaves: the requests are cancelled
        client.close()                                  # and the queued ones' connections (their headers
        fault.unlink(missing_ok=True)                   # were still to come) close too
    # back to idle, every figure: the engine sets its gauges one IPC at a time, the request counts before
    # the LoRA info, so a scrape between the two saw no request running beside 'poet' still running (a
    # clean-clone run on a Zen 3 EPYC); the LoRA lists are waited for with the rest
    last = {}

    def idle():
        p = last["figures"] = protocol_or_none(url)
        return p if p and p["running"] + p["waiting"] + p["used"] == 0 and lists(p["lora"]) == (set(), set()) else None
    try:
        after = wait_until(idle, timeout=60)
    except AssertionError:
        raise AssertionError(f"the protocol's figures never went back to idle: last {last.get('figures')}") from None
    assert after["usage"] == 0


def _gauges(metrics_url: str) -> list:
    """The engines' request, block and LoRA gauges on Triton's port (what `aggregate` sums)."""
    return [s for s in read_page(metrics_url, timeout=10)
            if s.name.startswith(("inflight_num_requests", "inflight_kv_blocks", "inflight_lora_requests_info"))]


def _settled(read):
    """(read()'s value,) once two reads 0.3 s apart agree (the engines' gauges refresh every 0.1 s; a
    frozen engine's last tokens are still on their way), else None."""
    import time
    first = read()
    time.sleep(0.3)
    second = read()
    return (second,) if first == second else None


def test_tritons_port_has_the_info_gauges_per_instance(gateway):
    """Per instance: one cache_config_info; lora_requests_info as vLLM keeps it, a series per set of
    labels seen, the current one (idle, now) the newest."""
    triton, _, _ = gateway
    def idle():
        """Triton's series once both instances' newest LoRA info is idle (the test before cancels its
        requests; an engine ends a cancelled one at its next step)."""
        series = scrape(triton.metrics_url)
        newest = [max(((v, dict(ls)) for (n, ls), v in series.items() if n == "inflight_lora_requests_info"
                       and dict(ls)["instance"] == instance), key=lambda x: x[0])[1]
                  for instance in ("llm_0_0", "llm_0_1")]
        return series if all(i["running_lora_adapters"] == i["waiting_lora_adapters"] == "" for i in newest) else None
    series = wait_until(idle, timeout=60, interval=0.1)
    cache = [dict(ls) for (n, ls), _ in series.items() if n == "inflight_cache_config_info"]
    assert sorted(c["instance"] for c in cache) == ["llm_0_0", "llm_0_1"]
    assert {(c["block_size"], c["num_gpu_blocks"]) for c in cache} == {(str(BS), str(BLOCKS // 2))}
    for instance in ("llm_0_0", "llm_0_1"):
        lora = [(v, dict(ls)) for (n, ls), v in series.items()
                if n == "inflight_lora_requests_info" and dict(ls)["instance"] == instance]
        newest = max(lora, key=lambda x: x[0])[1]
        assert (newest["max_lora"], newest["running_lora_adapters"], newest["waiting_lora_adapters"]) == ("1", "", "")


def test_a_silent_triton_metrics_port_fails_the_scrape_and_says_why(gateway):
    import socket
    import urllib.error
    import urllib.request

    from serving.triton_launcher import free_port

    triton, _, _ = gateway
    with socket.socket() as silent:                     # accepts connections, never answers
        silent.bind(("127.0.0.1", free_port()))
        silent.listen()
        port = silent.getsockname()[1]
        with OpenAIServer(triton.grpc_url, metrics_url=f"http://127.0.0.1:{port}/metrics") as api:
            with pytest.raises(urllib.error.HTTPError) as err:
                urllib.request.urlopen(f"{api.url}/metrics", timeout=30)
    body = err.value.read().decode()
    assert err.value.code == 503 and f"127.0.0.1:{port}/metrics did not answer" in body and "timeout" in body
