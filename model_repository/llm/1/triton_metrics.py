"""The engine's metrics as Triton custom metrics (docs/design.md lists them), for model.py.

Triton's MetricFamily class is passed in rather than imported here, so tests that load model.py
with a fake triton_python_backend_utils each get their own (a module imported once would keep
the first fake's).
"""
import time

from triton_outputs import lora_info_labels

TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0]
ITL_BUCKETS = [0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5]
QUEUE_BUCKETS = [0.0, 0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0]
# Tokens a speculating sequence gets from one verify step: its accepted drafts + 1 (vLLM's acceptance length)
ACCEPTANCE_BUCKETS = [1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 24, 33]
E2E_BUCKETS = [0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0]


class Metrics:
    """The docs/design.md metrics as Triton custom metrics. The families stay attributes of this object
    (owned by the model): a MetricFamily that is garbage-collected takes its metrics with it.
    `metric_family`: the Triton Python backend's MetricFamily class."""

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

    def __init__(self, labels, metric_family):
        fam = self._fam = metric_family
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
        fam, families = self._fam, {}
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
            fam = self._fam
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
