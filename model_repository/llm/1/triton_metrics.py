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
# Families made at the engine's first report of them (a model without experts or tiers shows none),
# each group's together in the table's order.
LATER = (table.MOE, table.KV_TIERS)
# The KV tiers' figures (stats()["kv_tiers"][tier]) by key: (metric, the labels the key fixes).
TIER_KEYS = {key: (m, fixed) for m in table.TRITON if m.when == table.KV_TIERS for key, fixed in m.keys.items()}
# Every counter outside LATER, by stats key: (metric, the labels the key fixes). LoRA's are reported
# (and so made) only by an engine with LoRA.
COUNTERS = [(m, key, fixed) for m in table.TRITON if m.kind == table.COUNTER and m.when not in LATER
            for key, fixed in m.keys.items()]


class Metrics:
    """The table's metrics as Triton custom metrics. The families stay attributes of this object
    (owned by the model): a MetricFamily that is garbage-collected takes its metrics with it.
    `metric_family`: the Triton Python backend's MetricFamily class. A series is made once, by
    `_series`, when first set or counted (or at start, to be exported at 0 from the first scrape);
    a counter follows the engine's running total (`_count`), a gauge its value (`_gauge`)."""

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
        self._by_name = {}   # family name -> MetricFamily
        self._made = {}      # series key -> Metric
        self._counted = {}   # counter series key -> the total counted so far
        self._last = {}      # gauge key -> the value last set
        self.labels = labels
        for m in table.TRITON:
            if m.when not in LATER:
                self._family_of(m)
        for m, key, fixed in COUNTERS:  # at 0 from the first scrape (LoRA's: when an engine with LoRA reports)
            if m.when != table.LORA:
                self._series(("count", key), m, fixed)
        self.blocks = BY_KEY["kv_blocks_used"]  # by stats key; reserved: the running requests' reservation
        for key, fixed in self.blocks.keys.items():
            self._series(("gauge", key), self.blocks, fixed)
        self.hist = {key: self._family_of(m).Metric(labels=labels, buckets=list(m.buckets)) for m in table.TRITON
                     if m.kind == table.HISTOGRAM for key in m.keys}
        self._lengths = []  # verify steps counted so far, by tokens they gave (the engine's tally)
        self.lora_info = None
        self.max_loras = 0  # 0: LoRA off, no lora_requests_info (as vLLM without a LoRA config)

    def _family(self, metric):
        f = self._fam(name=metric.name, description=metric.help, kind=self._kinds[metric.kind])
        self.families.append(f)
        return f

    def _family_of(self, metric):
        """metric's family, made on first use (a LATER group's families all at once, in the table's order)."""
        if metric.name not in self._by_name:
            group = [m for m in table.TRITON if m.when == metric.when] if metric.when in LATER else [metric]
            for m in group:
                self._by_name[m.name] = self._family(m)
        return self._by_name[metric.name]

    def _series(self, key, metric, fixed):
        """The series `key` of metric with the instance's labels and `fixed`, made on first use."""
        if key not in self._made:
            self._made[key] = self._family_of(metric).Metric(labels={**self.labels, **fixed})
        return self._made[key]

    def _count(self, key, metric, fixed, total):
        """A counter that follows the engine's running `total`."""
        series = self._series(key, metric, fixed)
        if total > self._counted.get(key, 0):
            series.increment(total - self._counted.get(key, 0))
            self._counted[key] = total

    def _gauge(self, key, metric, fixed, value):
        self._set(key, self._series(key, metric, fixed), value)

    def describe(self, block_size, num_blocks, max_loras):
        """The engine's fixed figures: its cache's shape, and max_loras (0 without LoRA)."""
        self._gauge("cache_info", BY_KEY["cache_config"], {"block_size": str(block_size),
                                                           "num_gpu_blocks": str(num_blocks)}, 1)
        self.max_loras = max_loras

    def observe(self, kind, seconds):
        self.hist[kind].observe(max(0.0, seconds))

    def update(self, stats):
        # counters first: a scrape mid-update must not see a snapshot's gauges with older counters
        for m, key, fixed in COUNTERS:
            if m.when != table.LORA or key in stats:
                self._count(("count", key), m, fixed, stats.get(key, 0))
        for key in ("num_requests_running", "num_requests_waiting"):
            self._gauge(key, BY_KEY[key], {}, stats[key])
        self._gauge("num_beams_running", BY_KEY["num_beams_running"], {}, stats.get("num_beams_running", 0))
        # images (docs/vision.md); 0 for a text-only model
        self._gauge("encoder_cache_bytes", BY_KEY["encoder_cache_bytes"], {}, stats.get("encoder_cache_bytes", 0))
        total, used = stats["kv_blocks_total"], stats["kv_blocks_used"]
        self._gauge("usage", BY_KEY["kv_cache_usage_ratio"], {}, used / total if total else 0.0)
        for key, fixed in self.blocks.keys.items():
            self._gauge(("gauge", key), self.blocks, fixed, stats.get(key, 0))
        # per LoRA adapter and state (running, waiting): a series for every adapter loaded, made on first sight
        for adapter, counts in stats.get("lora_requests", {}).items():
            for state, value in counts.items():
                self._gauge(("lora", adapter, state), BY_KEY["lora_requests"], {"adapter": adapter, "state": state},
                            value)
        if self.max_loras:
            self._lora_info(lora_info_labels(stats.get("lora_requests", {}), self.max_loras))
        self._update_moe(stats)
        for tier, figures in (stats.get("kv_tiers") or {}).items():
            for key, value in figures.items():
                if key in TIER_KEYS:
                    m, fixed = TIER_KEYS[key]
                    (self._gauge if m.kind == table.GAUGE else self._count)(
                        ("tier", tier, key), m, {"tier": tier, **fixed}, value)
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
        for e, n in enumerate(tokens):
            self._count(("moe", e), BY_KEY["moe_expert_tokens"], {"expert": str(e)}, n)
        self._gauge("moe_imbalance", BY_KEY["moe_load_imbalance"], {}, stats.get("moe_load_imbalance", 0.0))

    def _lora_info(self, labels):
        """The series of these labels, stamped now when they change. Triton keeps every series made
        (as vLLM's Prometheus client does): the current one is the newest."""
        if self._last.get("lora_info") != labels:
            self.lora_info = self._family_of(BY_KEY["lora_info"]).Metric(labels={**self.labels, **labels})
            self.lora_info.set(time.time())
            self._last["lora_info"] = labels

    def _set(self, key, metric, value):
        if self._last.get(key) != value:  # each set is an IPC to the server: only on change
            metric.set(value)
            self._last[key] = value
