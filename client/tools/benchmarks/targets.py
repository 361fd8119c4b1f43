"""The things `inflight bench` measures, each with `run(items, concurrency, progress)` -> one result
row: the engine in this process (`InProcessTarget`), `LLM.generate` on the whole workload
(`OfflineTarget`), and a running tritonserver over gRPC or HTTP (`ServerTarget`)."""
from __future__ import annotations

import asyncio
import json
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any, Optional, Sequence

from client.tools.benchmarks.measure import METRIC_KEYS, Record, Sampler, _progress, cpu_figures, summarize
from client.tools.benchmarks.mm_requests import EngineRequests, openai_chunks
from client.tools.benchmarks.workloads import DEFAULT_VOCAB_SIZE, WorkItem
from templates.exposition import read_page


# -- in-process --------------------------------------------------------------------------------
class InProcessTarget:
    """One AsyncEngine (the engine the server runs) built for one batching mode."""
    name = "in-process"

    def __init__(self, model_path: str, mode: str, params: dict[str, str]):
        from backend.core.config import EngineConfig
        from backend.engine.async_engine import AsyncEngine

        self.mode = mode
        self.config = EngineConfig.from_params(params, model_path=str(model_path), batching_mode=mode)
        self.engine = AsyncEngine(self.config)
        self.vocab_size = self.engine.vocab_size
        self.requests = EngineRequests(str(model_path), self.engine.tokenizer)  # images, embeddings (mm_requests.py)
        self._runs = 0

    def close(self) -> None:
        self.engine.shutdown()

    def _stats(self) -> dict:
        s = self.engine.stats()
        return {"kv": s["kv_cache_usage_ratio"], "running": s["num_requests_running"],
                "waiting": s["num_requests_waiting"], "preemptions": s["num_preemptions"]}

    def run(self, items: Sequence[WorkItem], concurrency: int, progress: bool = False,
            timeout: float = 3600.0) -> dict[str, Any]:
        from backend.core.sampling_params import SamplingParams

        self._runs += 1
        records = [Record(item) for item in items]
        slots = threading.Semaphore(concurrency)
        done = threading.Event()
        lock = threading.Lock()
        remaining = [len(records)]
        bar = _progress(len(records), f"{self.name} {self.mode} c={concurrency}", progress)

        def finish(rec: Record) -> None:
            slots.release()
            with lock:
                remaining[0] -= 1
                bar.update(1)
                if remaining[0] == 0:
                    done.set()

        def callback(rec: Record):
            def on_output(out) -> None:
                now = time.monotonic()
                if out.new_token_ids:
                    rec.chunks.append((now, len(out.new_token_ids)))
                if out.finished:
                    rec.end = now
                    rec.num_output_tokens = len(out.token_ids)
                    rec.finish_reason = out.finish_reason
                    rec.error = out.error
                    finish(rec)
            return on_output

        before = self._stats()["preemptions"]
        cpu0 = time.process_time()
        with Sampler(self._stats) as sampler:
            start = time.monotonic()
            for rec in records:
                delay = start + rec.item.arrival_s - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                slots.acquire()
                rec.start = time.monotonic()
                params = SamplingParams(max_tokens=rec.item.max_tokens, temperature=0.0,
                                        ignore_eos=rec.item.ignore_eos)
                try:
                    self.engine.add_request(f"bench{self._runs}-{rec.item.index}", self.requests.prompt(rec.item), params,
                                            callback(rec), **self.requests.kwargs(rec.item))
                except Exception as exc:  # refused at arrival (too long, queue full)
                    rec.error = f"{type(exc).__name__}: {exc}"
                    finish(rec)
            if not done.wait(timeout):  # bounded run: what is still unanswered is aborted (and fails)
                for rec in records:
                    if rec.end is None and rec.error is None:
                        self.engine.abort(f"bench{self._runs}-{rec.item.index}")
                done.wait(30.0)
            duration = time.monotonic() - start
        cpu = time.process_time() - cpu0
        bar.close()
        result = {**summarize(records, duration), **sampler.report(before)}
        return {**result, **cpu_figures(result["output_tokens"], cpu)}  # this process: engine + client


class OfflineTarget:
    """`LLM(...).generate(all prompts)` for one batching mode: offline throughput, no latencies."""
    name = "offline"

    def __init__(self, model_path: str, mode: str, params: dict[str, str]):
        import dataclasses

        from backend import LLM
        from backend.core.config import EngineConfig

        self.mode = mode
        config = EngineConfig.from_params(params, model_path=str(model_path), batching_mode=mode)
        overrides = {k: v for k, v in dataclasses.asdict(config).items() if k != "model_path"}
        self.llm = LLM(str(model_path), **overrides)

    def close(self) -> None:
        pass

    def run(self, items: Sequence[WorkItem], concurrency: int, progress: bool = False,
            timeout: float = 3600.0) -> dict[str, Any]:
        from backend.core.sampling_params import SamplingParams

        params = [SamplingParams(max_tokens=w.max_tokens, temperature=0.0, ignore_eos=w.ignore_eos) for w in items]
        before = self.llm.stats()["num_preemptions"]
        cpu0, start = time.process_time(), time.monotonic()
        outputs = self.llm.generate([w.prompt for w in items], params, use_tqdm=progress)
        duration, cpu = time.monotonic() - start, time.process_time() - cpu0
        tokens = sum(len(o.token_ids) for o in outputs)
        failed = sum(o.finish_reason in ("abort", "error") for o in outputs)
        none = dict.fromkeys(METRIC_KEYS[2:])
        return {"num_requests": len(items), "completed": len(items) - failed, "failed": failed,
                "duration_s": duration, "output_tokens": tokens, "output_tokens_per_s": tokens / duration,
                "requests_per_s": (len(items) - failed) / duration, **none, "errors": [],
                "kv_usage_peak": None, "kv_usage_mean": None, "running_mean": None,
                "preemptions": self.llm.stats()["num_preemptions"] - before, **cpu_figures(tokens, cpu)}


# -- through the server ------------------------------------------------------------------------
def scrape(metrics_url: str, timeout: float = 2.0) -> dict[str, float]:
    """Our gauges and counters from the Prometheus endpoint, summed over labels (one model); the
    series split by a `state` label left out."""
    values: dict[str, float] = {}
    for sample in read_page(metrics_url, timeout):
        if sample.name.startswith("inflight_") and "state" not in sample.labels:
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return values


def default_metrics_url(url: str) -> str:
    host = url.split("://")[-1].rsplit(":", 1)[0] or "localhost"
    return f"http://{host}:8002/metrics"


class ServerTarget:
    """A running tritonserver serving `llm`: gRPC streaming (or HTTP generate_stream)."""

    def __init__(self, url: str, protocol: str = "grpc", metrics_url: Optional[str] = None,
                 vocab_size: int = DEFAULT_VOCAB_SIZE, server_pid: Optional[int] = None,
                 stream: bool = True):
        self.url, self.protocol, self.stream = url, protocol, stream
        self.server_pid = server_pid  # a local server we started: its CPU seconds are counted too
        self.name = f"server-{protocol}" + ("" if stream else "-nostream")
        self.metrics_url = metrics_url or default_metrics_url(url)
        self.vocab_size = vocab_size
        self.mode = self._server_mode()

    def close(self) -> None:
        pass

    def _server_mode(self) -> str:
        """The server's batching_mode, from its model configuration (the OpenAI port does not say)."""
        if self.protocol == "openai":
            return "unknown"
        try:
            if self.protocol == "grpc":
                import tritonclient.grpc as g
                config = g.InferenceServerClient(self.url).get_model_config("llm", as_json=True)["config"]
            else:
                base = self.url if "://" in self.url else f"http://{self.url}"
                with urllib.request.urlopen(f"{base}/v2/models/llm/config", timeout=10) as r:
                    config = json.loads(r.read())
            params = config.get("parameters", {})
            static = params.get("executor_static_batch_size", {}).get("string_value", "-1")
            if static.strip() not in ("", "-1", "0"):
                return "static"
            return params.get("batching_mode", {}).get("string_value", "inflight")
        except Exception as exc:
            print(f"inflight bench: could not read the server's batching_mode ({exc})", file=sys.stderr)
            return "unknown"

    def _stats(self) -> Optional[dict]:
        m = scrape(self.metrics_url)
        return {"kv": m.get("inflight_kv_cache_usage_ratio"), "running": m.get("inflight_num_requests_running"),
                "waiting": m.get("inflight_num_requests_waiting"),
                "preemptions": m.get("inflight_num_preemptions_total")}

    def run(self, items: Sequence[WorkItem], concurrency: int, progress: bool = False,
            timeout: float = 3600.0) -> dict[str, Any]:
        try:
            before = self._stats()["preemptions"]
        except Exception:
            before = None
        cpu0 = self._cpu()
        with Sampler(self._stats, interval=0.25) as sampler:
            records, duration = asyncio.run(self._run(items, concurrency, progress, timeout))
        result = {**summarize(records, duration), **sampler.report(before)}
        if cpu0 is not None:  # tritonserver + its stub + this client, as in-process counts engine + client
            result.update(cpu_figures(result["output_tokens"], self._cpu() - cpu0))
        return result

    async def _chunks(self, client, item: WorkItem):
        """The responses of one request: one per step when streaming, else one at the end."""
        options = dict(max_tokens=item.max_tokens, temperature=0.0, ignore_eos=item.ignore_eos,
                       exclude_input_in_output=True)
        if item.images or item.kind == "embed":  # the images and embeddings workloads (mm_requests.py)
            if self.protocol != "openai":
                from client.protocol import GenerationError
                raise GenerationError("the images and embeddings workloads go through --protocol openai")
            async for chunk in openai_chunks(client, item, stream=self.stream, **options):
                yield chunk
            return
        if self.protocol in ("grpc", "openai"):
            async for chunk in client.stream(item.prompt, stream=self.stream, **options):
                yield chunk
        elif self.stream:
            async for chunk in client.stream(item.prompt, **options):
                yield chunk
        else:
            from client.protocol import Chunk
            r = await client.generate(item.prompt, **options)
            yield Chunk(r.text, r.token_ids, r.finish_reason, r.num_input_tokens, r.num_output_tokens,
                        time=r.end or time.monotonic())

    def _cpu(self) -> Optional[float]:
        """CPU seconds so far of the local server (tritonserver and its stubs) and this client."""
        if self.server_pid is None:
            return None
        import psutil

        from client.tools.load.soak import cpu_seconds  # here: client.tools.load.soak imports the bench's reporting
        try:
            return time.process_time() + sum(cpu_seconds(self.server_pid).values())
        except psutil.Error:
            return None

    async def _run(self, items, concurrency, progress, timeout):
        if self.protocol == "grpc":
            from client.grpc_client import AsyncGrpcClient as Client
        elif self.protocol == "openai":
            Client = OpenAICompletions  # noqa: N806
        else:
            from client.http_client import AsyncHttpClient as Client
        records = [Record(item) for item in items]
        slots = asyncio.Semaphore(concurrency)
        bar = _progress(len(records), f"{self.name} {self.mode} c={concurrency}", progress)
        async with Client(self.url) as client:
            start = time.monotonic()

            async def one(rec: Record) -> None:
                delay = start + rec.item.arrival_s - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                async with slots:
                    rec.start = time.monotonic()
                    try:
                        async for chunk in self._chunks(client, rec.item):
                            n = len(chunk.token_ids)
                            if n:
                                rec.chunks.append((chunk.time, n))
                                rec.num_output_tokens += n
                            if chunk.finished:
                                rec.end = chunk.time
                                rec.finish_reason = chunk.finish_reason
                                # a count the responses did not show one by one (the OpenAI port's usage)
                                rec.num_output_tokens = max(rec.num_output_tokens, chunk.num_output_tokens)
                                break
                        if rec.end is None:
                            rec.error = "the stream ended without a final response"
                    except Exception as exc:
                        rec.error = f"{type(exc).__name__}: {exc}"
                    bar.update(1)

            await asyncio.wait_for(asyncio.gather(*(one(r) for r in records)), timeout)
            duration = time.monotonic() - start
        bar.close()
        return records, duration


# -- the OpenAI port ---------------------------------------------------------------------------
class OpenAICompletions:
    """`/v1/completions` of an OpenAI-compatible server (inflight's port 9000, vLLM, ...), as the
    bench's other clients: `stream(prompt, **options)` yields one Chunk per server-sent event. An
    event carries no token count, so each one with text counts as one token for the inter-token
    gaps, as vLLM's benchmark_serving counts them (inflight sends one per engine step: one token
    at stream_interval 1, two when the first decoded to no text yet); the request's output tokens
    are the final usage's. The model is the first of /v1/models."""

    def __init__(self, url: str, timeout: float = 600.0):
        self.base = (url if "://" in url else f"http://{url}").rstrip("/")
        self.timeout = timeout
        self._session = None
        self._model: Optional[str] = None

    async def __aenter__(self) -> "OpenAICompletions":
        import aiohttp
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout))
        async with self._session.get(f"{self.base}/v1/models") as r:
            r.raise_for_status()
            self._model = (await r.json())["data"][0]["id"]
        return self

    async def __aexit__(self, *exc) -> None:
        await self._session.close()

    async def stream(self, prompt, *, stream: bool = True, max_tokens: int, temperature: float = 0.0,
                     ignore_eos: bool = True, exclude_input_in_output: bool = True):
        body = {"model": self._model, "prompt": prompt if isinstance(prompt, str) else list(prompt),
                "max_tokens": max_tokens, "temperature": temperature, "ignore_eos": ignore_eos, "stream": stream,
                **({"stream_options": {"include_usage": True}} if stream else {})}
        async with self._session.post(f"{self.base}/v1/completions", json=body) as r:
            async for chunk in read_openai_response(r, stream, lambda choice: choice.get("text") or ""):
                yield chunk


def chat_text(choice: dict) -> str:
    """A chat completion choice's text: a streamed chunk's delta, or the whole message."""
    return (choice.get("delta") or choice.get("message") or {}).get("content") or ""


async def read_openai_response(r, stream: bool, text_of):
    """An OpenAI-port response (aiohttp) as the bench's Chunks: the whole answer once, or streamed
    (server-sent events) one chunk per piece of text, then the finish reason with the usage's token
    count. `text_of(choice)`: the text in a choice (completions' `text`, chat's `chat_text`)."""
    from client.protocol import Chunk, GenerationError
    if r.status != 200:
        raise GenerationError(f"HTTP {r.status}: {(await r.text())[:300]}")
    if not stream:
        data = await r.json()
        choice, n = data["choices"][0], data.get("usage", {}).get("completion_tokens", 1)
        yield Chunk(text_of(choice), [-1] * n, choice["finish_reason"], 0, n)
        return
    final = None  # the finish reason's chunk, held until the usage (the true token count)
    async for raw in r.content:
        line = raw.decode("utf-8").strip()
        if not line.startswith("data:") or line[5:].strip() == "[DONE]":
            continue
        event = json.loads(line[5:])
        if "error" in event:
            raise GenerationError(str(event["error"])[:300])
        for choice in event.get("choices", []):
            text, reason = text_of(choice), choice.get("finish_reason")
            if text:
                yield Chunk(text, [-1], None, 0, 1)
            if reason:
                final = Chunk("", [], reason, 0, 0)
        if event.get("usage") and final is not None:
            final.num_output_tokens = event["usage"].get("completion_tokens", 0)
    if final is not None:
        yield final


# -- a local tritonserver for --compare-server -------------------------------------------------
def start_local_server(model_path: str, params: dict[str, str]):
    """A tritonserver on free loopback ports serving model_path with the rendered default config
    (KIND_CPU when there is no GPU) plus `params`. Returns the started TritonServer."""
    import tempfile

    from serving.triton_launcher import TritonServer
    from templates.render import detect_gpus, write_config

    repo = Path(tempfile.mkdtemp(prefix="inflight-bench-repo-"))
    write_config(repo / "llm" / "config.pbtxt", gpus=detect_gpus())
    code = Path(__file__).resolve().parents[3] / "model_repository" / "llm" / "1"
    (repo / "llm" / "1").symlink_to(code, target_is_directory=True)
    server = TritonServer(repo, params=params, model_path=str(model_path))
    server.start()
    try:
        server.wait_ready(600)
    except BaseException:
        server.stop()
        raise
    return server
