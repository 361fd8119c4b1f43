"""The engine's metrics as Triton custom metrics, for model.py. Their names, help texts, labels and
buckets, and the stats() key each is read from, are the table in templates/metrics.py
(docs/metrics.md); nothing here names a metric.

Triton's MetricFamily class is passed in rather than imported here, so tests that load model.py
with a fake triton_python_backend_utils each get their own (a module imported once would keep
the first fake's).
"""
import time

from templates import metrics as table
from triton_outputs import lora_info_labels

BY_KEY = table.by_key(table.TRITON)
# Made at the engine's first report of them (a model without experts or tiers shows none).
LATER = (table.MOE, table.KV_TIERS)
# The KV tiers' figures (stats()["kv_tiers"][tier]) by key: (metric, the labels the key fixes).
TIER_KEYS = {key: (m, fixed) for m in table.TRITON if m.when == table.KV_TIERS for key, fixed in m.keys.items()}


class Metrics:
    """The table's metrics as Triton custom metrics. The families stay attributes of this object
    (owned by the model): a MetricFamily that is garbage-collected takes its metrics with it.
    `metric_family`: the Triton Python backend's MetricFamily class."""

    @staticmethod
    def instance_labels(args, device):
        """The labels of one instance's metrics: model and version, plus the instance (`llm_0_1`) and
        its device (`cpu`, `cuda:1`). Each instance runs its own engine, so without them N
        instances would write one gauge (the last writer wins); with them the gauges of the
        instances sum to the server's totals, and queries and autoscalers sum over `instance`."""
        values = (args["model_name"], args["model_version"], args["model_instance_name"], str(device))
        return dict(zip(table.INSTANCE_LABELS, values))

    def __init__(self, labels, metric_family):
        fam = self._fam = metric_family
        self._kinds = {table.GAUGE: fam.GAUGE, table.INFO: fam.GAUGE, table.COUNTER: fam.COUNTER,
                       table.HISTOGRAM: fam.HISTOGRAM}
        self.families = []
        self.labels = labels
        made = {m.name: self._family(m) for m in table.TRITON if m.when not in LATER}

        def family(key):
            return made[BY_KEY[key].name]

        def one(key):
            return family(key).Metric(labels=labels)

        self.running, self.waiting = one("num_requests_running"), one("num_requests_waiting")
        self.beams = one("num_beams_running")
        self.encoder_bytes = one("encoder_cache_bytes")  # images (docs/vision.md); 0 for a text-only model
        self.usage = one("kv_cache_usage_ratio")
        blocks = BY_KEY["kv_blocks_used"]  # by stats key; reserved: the running requests' reservation
        self.blocks = {key: made[blocks.name].Metric(labels={**labels, **fixed}) for key, fixed in blocks.keys.items()}
        # per LoRA adapter and state (running, waiting): a series for every adapter loaded, made on first sight
        self.lora_family = family("lora_requests")
        self.lora = {}
        counters = [(m, key, fixed) for m in table.TRITON if m.kind == table.COUNTER and m.when not in LATER
                    for key, fixed in m.keys.items()]
        self.counters = {key: made[m.name].Metric(labels={**labels, **fixed}) for m, key, fixed in counters
                         if m.when != table.LORA}
        # LoRA's counters: made when the engine first reports them (only an engine with LoRA does)
        self._lora_counters = {key: (made[m.name], fixed) for m, key, fixed in counters if m.when == table.LORA}
        self._counted = {k: 0 for k in self.counters}
        self.hist = {key: made[m.name].Metric(labels=labels, buckets=list(m.buckets)) for m in table.TRITON
                     if m.kind == table.HISTOGRAM for key in m.keys}
        self._lengths = []  # verify steps counted so far, by tokens they gave (the engine's tally)
        self._last = {}
        # The inference gateway's model-server protocol (docs/gateway.md): info gauges whose labels
        # are the values, as vLLM's cache_config_info and lora_requests_info
        self.cache_info_family, self.lora_info_family = family("cache_config"), family("lora_info")
        self.cache_info = self.lora_info = None
        self.max_loras = 0  # 0: LoRA off, no lora_requests_info (as vLLM without a LoRA config)
        self.moe = None  # (tokens per expert counters, imbalance gauge): made when a MoE model reports
        self.tiers = None  # the KV tiers' series (kv_host_cache_bytes), made when the engine first reports them

    def _family(self, metric):
        f = self._fam(name=metric.name, description=metric.help, kind=self._kinds[metric.kind])
        self.families.append(f)
        return f

    def describe(self, block_size, num_blocks, max_loras):
        """The engine's fixed figures: its cache's shape, and max_loras (0 without LoRA)."""
        self.cache_info = self.cache_info_family.Metric(
            labels={**self.labels, "block_size": str(block_size), "num_gpu_blocks": str(num_blocks)})
        self.cache_info.set(1)
        self.max_loras = max_loras

    def _tier_series(self, tiers):
        families = {m.name: self._family(m) for m in table.TRITON if m.when == table.KV_TIERS}
        series = {}
        for tier, figures in tiers.items():
            for key in figures:
                if key in TIER_KEYS:
                    m, fixed = TIER_KEYS[key]
                    series[(tier, key)] = families[m.name].Metric(labels={**self.labels, "tier": tier, **fixed})
        return series

    def _update_tiers(self, tiers):
        if self.tiers is None:
            self.tiers = self._tier_series(tiers)
        for (tier, key), metric in self.tiers.items():
            value = tiers[tier][key]
            if TIER_KEYS[key][0].kind == table.GAUGE:
                self._set(("tier", tier, key), metric, value)
            elif value > self._counted.get((tier, key), 0):
                metric.increment(value - self._counted.get((tier, key), 0))
                self._counted[(tier, key)] = value

    def observe(self, kind, seconds):
        self.hist[kind].observe(max(0.0, seconds))

    def update(self, stats):
        # counters first: a scrape mid-update must not see a snapshot's gauges with older counters
        for key in [k for k in self._lora_counters if k in stats]:
            family, fixed = self._lora_counters.pop(key)
            self.counters[key], self._counted[key] = family.Metric(labels={**self.labels, **fixed}), 0
        for key, metric in self.counters.items():
            delta = stats.get(key, 0) - self._counted[key]
            if delta > 0:
                metric.increment(delta)
                self._counted[key] += delta
        self._set("running", self.running, stats["num_requests_running"])
        self._set("waiting", self.waiting, stats["num_requests_waiting"])
        self._set("beams", self.beams, stats.get("num_beams_running", 0))
        self._set("encoder_bytes", self.encoder_bytes, stats.get("encoder_cache_bytes", 0))
        total, used = stats["kv_blocks_total"], stats["kv_blocks_used"]
        self._set("usage", self.usage, used / total if total else 0.0)
        for key, metric in self.blocks.items():
            self._set(key, metric, stats.get(key, 0))
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
                self.hist["spec_decode_acceptance_lengths"].observe(i + 1)
        self._lengths = list(lengths)

    def _update_moe(self, stats):
        """Mixtures of experts: tokens routed to each expert (summed over the layers; a token counts
        once per expert it picks) and the last interval's load imbalance (busiest expert / mean)."""
        tokens = stats.get("moe_expert_tokens")
        if not tokens:
            return
        if self.moe is None:
            counter, gauge = self._family(BY_KEY["moe_expert_tokens"]), self._family(BY_KEY["moe_load_imbalance"])
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
