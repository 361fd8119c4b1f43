"""The `llm` model: a thin decoupled Triton Python-backend adapter around the inflight engine.

initialize: config.pbtxt parameters -> EngineConfig, one AsyncEngine on the instance's device.
execute:    each request's tensors are validated and handed to the engine with its response
            sender; returns None at once. Responses go out from adapter.Frontend's thread.
finalize:   stops the engine loop; every request still open gets its FINAL response.
The logic lives in adapter.py beside this file (no Triton imports there, so it is unit-tested).
"""
import json
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parents[2]  # model_repository/llm/1 -> the repository root
for path in (str(HERE), str(REPO_ROOT)):
    if path not in sys.path:
        sys.path.insert(0, path)

import triton_python_backend_utils as pb_utils  # noqa: E402

import adapter  # noqa: E402
from triton_outputs import lora_info_labels  # noqa: E402

INPUTS = adapter.INPUT_NAMES

STOP_FILE = ".inflight-stopping"  # client/tools/server.py creates it in its run copy before stopping Triton

TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0]
ITL_BUCKETS = [0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5]
QUEUE_BUCKETS = [0.0, 0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0]
# Tokens a speculating sequence gets from one verify step: its accepted drafts + 1 (vLLM's acceptance length)
ACCEPTANCE_BUCKETS = [1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 24, 33]
E2E_BUCKETS = [0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0]


class Metrics:
    """The docs/design.md metrics as Triton custom metrics. The families stay attributes of this object
    (owned by the model): a MetricFamily that is garbage-collected takes its metrics with it."""

    COUNTERS = {"num_preemptions": "inflight_num_preemptions_total",
                "prompt_tokens_total": "inflight_prompt_tokens_total",
                "generation_tokens_total": "inflight_generation_tokens_total",
                "num_backfilled": "inflight_num_backfilled_total",
                "spec_decode_num_draft_tokens": "inflight_spec_decode_num_draft_tokens_total",
                "spec_decode_num_accepted_tokens": "inflight_spec_decode_num_accepted_tokens_total",
                "spec_decode_num_failed_proposals": "inflight_spec_decode_num_failed_proposals_total"}

    @staticmethod
    def instance_labels(args, device):
        """The labels of one instance's metrics: model and version, plus the instance (`llm_0_1`) and
        its device (`cpu`, `cuda:1`). Each instance runs its own engine, so without them N
        instances would write one gauge (the last writer wins); with them the gauges of the
        instances sum to the server's totals, and queries and autoscalers sum over `instance`."""
        return {"model": args["model_name"], "version": args["model_version"],
                "instance": args["model_instance_name"], "device": str(device)}

    def __init__(self, labels):
        fam = pb_utils.MetricFamily
        self.families = []

        def family(name, doc, kind):
            f = fam(name=name, description=doc, kind=kind)
            self.families.append(f)
            return f

        self.running = family("inflight_num_requests_running", "Requests in the running batch",
                              fam.GAUGE).Metric(labels=labels)
        self.waiting = family("inflight_num_requests_waiting", "Requests waiting for admission",
                              fam.GAUGE).Metric(labels=labels)
        self.usage = family("inflight_kv_cache_usage_ratio", "Used share of the KV-cache blocks (0-1)",
                            fam.GAUGE).Metric(labels=labels)
        blocks = family("inflight_kv_blocks", "KV-cache blocks by state", fam.GAUGE)
        # reserved: what the running requests hold or may still need (no-evict's reservation)
        self.blocks = {s: blocks.Metric(labels={**labels, "state": s}) for s in ("used", "free", "total", "reserved")}
        docs = {"num_preemptions": "Requests preempted (max_utilization)",
                "prompt_tokens_total": "Prompt tokens admitted",
                "generation_tokens_total": "Tokens generated",
                "num_backfilled": "Requests started ahead of a waiting request that did not fit (enable_backfill)",
                "spec_decode_num_draft_tokens": "Draft tokens verified (speculative_config)",
                "spec_decode_num_accepted_tokens": "Draft tokens accepted (speculative_config)",
                "spec_decode_num_failed_proposals": "Steps whose draft proposal raised and ran without drafts "
                                                    "(speculative_config; the log has the error)"}
        # per LoRA adapter and state (running, waiting): a series for every adapter loaded, made on first sight
        self.lora_family = family("inflight_lora_requests", "Requests per LoRA adapter, running or waiting", fam.GAUGE)
        self.lora = {}
        self.labels = labels
        self.counters = {k: family(name, docs[k], fam.COUNTER).Metric(labels=labels)
                         for k, name in self.COUNTERS.items()}
        self._counted = {k: 0 for k in self.COUNTERS}
        self.hist = {
            "ttft": family("inflight_time_to_first_token_seconds", "Time to first token",
                           fam.HISTOGRAM).Metric(labels=labels, buckets=TTFT_BUCKETS),
            "itl": family("inflight_inter_token_latency_seconds", "Time between output tokens",
                          fam.HISTOGRAM).Metric(labels=labels, buckets=ITL_BUCKETS),
            "e2e": family("inflight_e2e_request_latency_seconds", "Request latency, arrival to last token",
                          fam.HISTOGRAM).Metric(labels=labels, buckets=E2E_BUCKETS),
            "queue": family("inflight_request_queue_time_seconds", "Time waiting for admission, arrival to first scheduled",
                            fam.HISTOGRAM).Metric(labels=labels, buckets=QUEUE_BUCKETS),
            "acceptance": family("inflight_spec_decode_acceptance_length",
                                 "Tokens a sequence got from one verify step: accepted drafts + 1 (speculative_config)",
                                 fam.HISTOGRAM).Metric(labels=labels, buckets=ACCEPTANCE_BUCKETS),
        }
        self._lengths = []  # verify steps counted so far, by tokens they gave (the engine's tally)
        self._last = {}
        # The inference gateway's model-server protocol (docs/gateway.md): info gauges whose labels
        # are the values, as vLLM's cache_config_info and lora_requests_info
        self.cache_info_family = family("inflight_cache_config_info", "KV-cache configuration in the labels: "
                                        "block_size (tokens), num_gpu_blocks; value 1", fam.GAUGE)
        self.lora_info_family = family("inflight_lora_requests_info", "LoRA adapters with running and waiting "
                                       "requests, and max_lora, in the labels; value: the Unix time they last "
                                       "changed", fam.GAUGE)
        self.cache_info = self.lora_info = None
        self.max_loras = 0  # 0: LoRA off, no lora_requests_info (as vLLM without a LoRA config)
        self._family = family
        self.moe = None  # (tokens per expert counters, imbalance gauge): made when a MoE model reports
        self.tiers = None  # the KV tiers' series (kv_host_cache_bytes), made when the engine first reports them

    def describe(self, block_size, num_blocks, max_loras):
        """The engine's fixed figures: its cache's shape, and max_loras (0 without LoRA)."""
        self.cache_info = self.cache_info_family.Metric(
            labels={**self.labels, "block_size": str(block_size), "num_gpu_blocks": str(num_blocks)})
        self.cache_info.set(1)
        self.max_loras = max_loras

    # The KV tiers' figures (LLMEngine.stats()["kv_tiers"], per tier): counters by their stats key.
    TIER_COUNTERS = {"hits": ("inflight_kv_tier_hits_total", "Prefix blocks started requests found in this tier", {}),
                     "misses": ("inflight_kv_tier_misses_total", "Prefix blocks started requests did not find here", {}),
                     "bytes_loaded": ("inflight_kv_tier_bytes_total", "KV bytes a tier moved: load (host: copied "
                                      "back to the device; disk: read) or store (host: copied from the device; disk: "
                                      "written)", {"direction": "load"}),
                     "bytes_stored": ("inflight_kv_tier_bytes_total", "", {"direction": "store"}),
                     "dropped": ("inflight_kv_tier_failures_total", "Blocks not kept (dropped: every host slot busy; "
                                 "rejected: a torn or foreign file; write_failed)", {"kind": "dropped"}),
                     "rejected": ("inflight_kv_tier_failures_total", "", {"kind": "rejected"}),
                     "write_failures": ("inflight_kv_tier_failures_total", "", {"kind": "write_failed"})}

    def _tier_series(self, tiers):
        fam, families = pb_utils.MetricFamily, {}
        for name, doc, _ in self.TIER_COUNTERS.values():
            if name not in families and doc:
                families[name] = self._family(name, doc, fam.COUNTER)
        blocks = self._family("inflight_kv_tier_blocks", "KV tier fill in blocks (state: used, total)", fam.GAUGE)
        series = {}
        for tier, figures in tiers.items():
            for key in figures:
                if key in self.TIER_COUNTERS:
                    name, _, extra = self.TIER_COUNTERS[key]
                    series[(tier, key)] = families[name].Metric(labels={**self.labels, "tier": tier, **extra})
                elif key.startswith("blocks_"):
                    series[(tier, key)] = blocks.Metric(labels={**self.labels, "tier": tier, "state": key[7:]})
        return series

    def _update_tiers(self, tiers):
        if self.tiers is None:
            self.tiers = self._tier_series(tiers)
        for (tier, key), metric in self.tiers.items():
            value = tiers[tier][key]
            if key.startswith("blocks_"):
                self._set(("tier", tier, key), metric, value)
            elif value > self._counted.get((tier, key), 0):
                metric.increment(value - self._counted.get((tier, key), 0))
                self._counted[(tier, key)] = value

    def observe(self, kind, seconds):
        self.hist[kind].observe(max(0.0, seconds))

    def update(self, stats):
        # counters first: a scrape mid-update must not see a snapshot's gauges with older counters
        for key, metric in self.counters.items():
            delta = stats.get(key, 0) - self._counted[key]
            if delta > 0:
                metric.increment(delta)
                self._counted[key] += delta
        self._set("running", self.running, stats["num_requests_running"])
        self._set("waiting", self.waiting, stats["num_requests_waiting"])
        total, used = stats["kv_blocks_total"], stats["kv_blocks_used"]
        self._set("usage", self.usage, used / total if total else 0.0)
        for state, key in (("used", "kv_blocks_used"), ("free", "kv_blocks_free"), ("total", "kv_blocks_total"),
                           ("reserved", "kv_blocks_reserved")):
            self._set(state, self.blocks[state], stats.get(key, 0))
        for adapter, counts in stats.get("lora_requests", {}).items():
            for state, value in counts.items():
                key = ("lora", adapter, state)
                if key not in self.lora:
                    self.lora[key] = self.lora_family.Metric(labels={**self.labels, "adapter": adapter, "state": state})
                self._set(key, self.lora[key], value)
        if self.max_loras:
            self._lora_info(lora_info_labels(stats.get("lora_requests", {}), self.max_loras))
        self._update_moe(stats)
        if stats.get("kv_tiers"):
            self._update_tiers(stats["kv_tiers"])
        lengths = stats.get("spec_decode_acceptance_lengths") or []
        for i, n in enumerate(lengths):  # the engine keeps a tally per length: observe what is new
            for _ in range(n - (self._lengths[i] if i < len(self._lengths) else 0)):
                self.hist["acceptance"].observe(i + 1)
        self._lengths = list(lengths)

    def _update_moe(self, stats):
        """Mixtures of experts: tokens routed to each expert (summed over the layers; a token counts
        once per expert it picks) and the last interval's load imbalance (busiest expert / mean)."""
        tokens = stats.get("moe_expert_tokens")
        if not tokens:
            return
        if self.moe is None:
            fam = pb_utils.MetricFamily
            counter = self._family("inflight_moe_expert_tokens_total",
                                   "Tokens routed to each expert, summed over the MoE layers", fam.COUNTER)
            gauge = self._family("inflight_moe_load_imbalance", "Tokens of the busiest expert over the mean, "
                                 "in the worst MoE layer, since the last report (1: even)", fam.GAUGE)
            self.moe = ([counter.Metric(labels={**self.labels, "expert": str(e)}) for e in range(len(tokens))],
                        gauge.Metric(labels=self.labels), [0] * len(tokens))
        counters, gauge, counted = self.moe
        for e, n in enumerate(tokens):
            if n > counted[e]:
                counters[e].increment(n - counted[e])
                counted[e] = n
        self._set("moe_imbalance", gauge, stats.get("moe_load_imbalance", 0.0))

    def _lora_info(self, labels):
        """The series of these labels, stamped now when they change. Triton keeps every series made
        (as vLLM's Prometheus client does): the current one is the newest."""
        if self._last.get("lora_info") != labels:
            self.lora_info = self.lora_info_family.Metric(labels={**self.labels, **labels})
            self.lora_info.set(time.time())
            self._last["lora_info"] = labels

    def _set(self, key, metric, value):
        if self._last.get(key) != value:  # each set is an IPC to the server: only on change
            metric.set(value)
            self._last[key] = value


def triton_error(error):
    """adapter.Error (a message with a code name) -> pb_utils.TritonError with that code."""
    code = getattr(pb_utils.TritonError, getattr(error, "code", "INTERNAL"), pb_utils.TritonError.INTERNAL)
    return pb_utils.TritonError(str(error), code)


def respond(sender, tensors, error, final):
    flags = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0
    if tensors is None and error is None:
        sender.send(flags=flags)
        return
    if error is not None:
        response = pb_utils.InferenceResponse(output_tensors=[], error=triton_error(error))
    else:
        response = pb_utils.InferenceResponse(
            output_tensors=[pb_utils.Tensor(name, value) for name, value in tensors.items()])
    sender.send(response, flags=flags)


class TritonPythonModel:
    def initialize(self, args):
        from backend.parent_watch import exit_with_parent
        exit_with_parent()  # a tritonserver killed abruptly must not leave this stub behind
        config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(config):
            raise pb_utils.TritonModelException(
                "the llm model must be decoupled: model_transaction_policy { decoupled: true }")
        params = {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}
        try:
            engine_config = adapter.engine_config(params, args["model_instance_kind"],
                                                  args["model_instance_device_id"], REPO_ROOT,
                                                  args.get("model_instance_name", ""))
        except ValueError as exc:
            raise pb_utils.TritonModelException(f"config.pbtxt: {exc}") from None

        from backend.async_engine import AsyncEngine  # torch loads here, after the config is known good

        try:
            self.engine = AsyncEngine(engine_config)
        except ValueError as exc:  # a size, adapter or checkpoint that does not fit: the reason, no traceback
            raise pb_utils.TritonModelException(f"inflight: {exc}") from None
        self.faults = adapter.FaultInjector.from_env(Path(args["model_repository"]))
        if self.faults is not None:  # tests only: see adapter.FaultInjector
            self.faults.install(self.engine)
            pb_utils.Logger.log_warn(f"inflight: FAULT INJECTION IS ARMED ({adapter.FAULT_ENV}=1): model steps "
                                     f"fail on demand through {self.faults.path}. For tests only.")
        self.metrics = Metrics(Metrics.instance_labels(args, self.engine.device))  # as resolved: cuda:1
        self.metrics.describe(engine_config.kv_block_size, self.engine.stats()["kv_blocks_total"],
                              engine_config.max_loras if engine_config.enable_lora else 0)
        self.model_name = args["model_name"]
        self.frontend = adapter.Frontend(self.engine, respond, self.metrics,
                                         stop_file=Path(args["model_repository"]) / STOP_FILE,
                                         stream_interval=engine_config.stream_interval,
                                         on_engine_failure=self.take_out_of_service)
        pb_utils.Logger.log_info(
            f"inflight: {args['model_instance_name']} on {self.engine.device}, model {engine_config.model_path}, "
            f"max_model_len {self.engine.max_model_len}, vocab {self.engine.vocab_size}, "
            f"KV blocks {self.engine.stats()['kv_blocks_total']}, weights: {self.engine.engine.runner.weights.summary}")

    def take_out_of_service(self, reason):
        """The engine stopped serving (a lost tensor-parallel rank, an unrecoverable fault): unload
        this model so Triton reports it not ready, as the vLLM backend does with an unhealthy
        engine. That needs --model-control-mode=explicit (`inflight serve` runs Triton so); in
        other modes the model stays loaded and refuses every request with UNAVAILABLE, which the
        liveness check (deploy/docker/healthcheck.py) reports."""
        pb_utils.Logger.log_error(f"inflight: the engine stopped serving: {reason}")

        def unload():
            try:
                pb_utils.unload_model(self.model_name)
                pb_utils.Logger.log_error(f"inflight: model '{self.model_name}' unloaded: it reports not ready")
            except Exception as exc:
                pb_utils.Logger.log_error(f"inflight: model '{self.model_name}' cannot unload itself ({exc}); it "
                                          "refuses every request with UNAVAILABLE until the server restarts")

        threading.Thread(target=unload, name="inflight-unload", daemon=True).start()

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                inputs = {}
                for name in INPUTS:
                    tensor = pb_utils.get_input_tensor_by_name(request, name)
                    inputs[name] = tensor.as_numpy() if tensor is not None else None
                parameters = request.parameters()
            except UnicodeDecodeError as exc:  # Triton's JSON passes "\ud800" on as bytes UTF-8 refuses
                respond(sender, None, adapter.Error(f"the request parameters are not valid UTF-8 text (a lone "
                                                    f"surrogate such as \\ud800?): {exc}", "INVALID_ARG"), True)
                continue
            self.frontend.submit(request.request_id(), inputs, sender, parameters)
        return None

    def finalize(self):
        frontend = getattr(self, "frontend", None)
        if frontend is not None:
            frontend.close()
