"""The metrics' names: one table that the Triton custom metrics (`model_repository/llm/1/triton_metrics.py`),
the OpenAI port's /metrics (`openai_server/metrics.py`), the Grafana dashboard (`deploy/grafana/inflight.json`,
checked against it by tests/test_metrics_table.py) and docs/metrics.md (written from it by
`python -m templates.metrics`) come from. Plain data: no torch, no Triton.

The names are a contract (docs/design.md, "Contracts"): never renamed, only added to.
`keys` says where each series' value comes from, each key with the labels it fixes:
- TRITON (Triton's metrics port, one series per model instance): an `LLMEngine.stats()` key (for the
  KV tiers' metrics, a key of `stats()["kv_tiers"][tier]`), the kind `Metrics.observe` takes for a
  latency the responder measures, or, for an info gauge, the name of its rule;
- GATEWAY (the OpenAI port's /metrics, the server's instances summed): a `PodFigures` figure.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping

# INFO: a gauge whose labels are the values (vLLM's cache_config_info), exported as a gauge
GAUGE, COUNTER, HISTOGRAM, INFO = "gauge", "counter", "histogram", "info gauge"
# When a series exists: ALWAYS from the model's start; else with the engine setting or model named.
ALWAYS, LORA, KV_TIERS, MOE = "always", "enable_lora", "kv_host_cache_bytes", "a mixture-of-experts model"
PREFIX = "inflight_"
INSTANCE_LABELS = ("model", "version", "instance", "device")  # every series on Triton's port carries them
GATEWAY_LABELS = ("model_name",)  # every series on the OpenAI port (the served model name)
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


@dataclass(frozen=True)
class Metric:
    name: str
    kind: str
    help: str
    keys: Mapping[str, Mapping[str, str]] = field(default_factory=dict)  # value source -> the labels it fixes
    labels: tuple[str, ...] = ()  # beside INSTANCE_LABELS / GATEWAY_LABELS
    rule: str = ""  # how the value is made, where the keys alone do not say
    buckets: tuple[float, ...] = ()
    when: str = ALWAYS
    vllm: str = ""  # GATEWAY: the vLLM name it is served under too
    values: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # label -> its values, where no key fixes them

    def label_values(self) -> dict[str, tuple[str, ...]]:
        """label -> the values it takes, where known (fixed by a key, or listed in `values`)."""
        out = {k: tuple(v) for k, v in self.values.items()}
        for fixed in self.keys.values():
            for k, v in fixed.items():
                out[k] = out.get(k, ()) + (() if v in out.get(k, ()) else (v,))
        return out

    def series(self) -> tuple[str, ...]:
        """The sample names it is exported under (a histogram's _bucket, _sum, _count)."""
        names = (self.name, self.vllm) if self.vllm else (self.name,)
        if self.kind == HISTOGRAM:
            return tuple(n + s for n in names for s in HISTOGRAM_SUFFIXES)
        return names


def _one(key: str) -> dict:
    return {key: {}}


def _states(prefix: str, label: str, states: Iterable[str]) -> dict:
    return {f"{prefix}{s}": {label: s} for s in states}


TRITON: tuple[Metric, ...] = (
    Metric("inflight_num_requests_running", GAUGE, "Requests in the running batch", _one("num_requests_running")),
    Metric("inflight_num_requests_waiting", GAUGE, "Requests waiting for admission", _one("num_requests_waiting")),
    Metric("inflight_kv_cache_usage_ratio", GAUGE, "Used share of the KV-cache blocks (0-1)",
           _one("kv_cache_usage_ratio"), rule="kv_blocks_used / kv_blocks_total (0 without blocks)"),
    Metric("inflight_kv_blocks", GAUGE, "KV-cache blocks by state", _states("kv_blocks_", "state",
           ("used", "free", "total", "reserved")), ("state",),
           rule="reserved: what the running requests hold or may still need (guaranteed_no_evict's reservation)"),
    Metric("inflight_lora_requests", GAUGE, "Requests per LoRA adapter, running or waiting", _one("lora_requests"),
           ("adapter", "state"), rule="a series per adapter loaded or asked for", when=LORA,
           values={"state": ("running", "waiting")}),
    Metric("inflight_lora_loads_total", COUNTER, "LoRA adapters loaded at run time (/v1/load_lora_adapter, "
           "lora_action load; docs/lora.md)", _one("lora_loads_total"), when=LORA),
    Metric("inflight_lora_unloads_total", COUNTER, "LoRA adapters unloaded at run time (each once its requests "
           "ended)", _one("lora_unloads_total"), when=LORA),
    Metric("inflight_num_preemptions_total", COUNTER, "Requests preempted (max_utilization)", _one("num_preemptions")),
    Metric("inflight_prompt_tokens_total", COUNTER, "Prompt tokens admitted", _one("prompt_tokens_total")),
    Metric("inflight_generation_tokens_total", COUNTER, "Tokens generated", _one("generation_tokens_total")),
    Metric("inflight_beam_requests_total", COUNTER, "Requests that ran beam search (use_beam_search, beam_width > 1)",
           _one("beam_requests_total")),
    Metric("inflight_num_beams_running", GAUGE, "Beams of the beam searches not yet ended (each a sequence)",
           _one("num_beams_running")),
    Metric("inflight_encoder_runs_total", COUNTER, "Images the vision encoder ran on (a vision-language model, "
           "docs/vision.md; an image found in the encoder cache or the prefix cache runs none)",
           _one("encoder_runs_total")),
    Metric("inflight_encoder_cache_hits_total", COUNTER, "Images whose encoder output the encoder cache held",
           _one("encoder_cache_hits_total")),
    Metric("inflight_encoder_cache_bytes", GAUGE, "Bytes of encoder outputs the encoder cache holds (at most "
           "encoder_cache_bytes, more only while running requests need them)", _one("encoder_cache_bytes")),
    Metric("inflight_pooling_requests_total", COUNTER, "Pooling requests answered (runner pooling: embeddings, "
           "scores; docs/pooling.md)", _one("pooling_requests_total")),
    Metric("inflight_pooling_prompt_tokens_total", COUNTER, "Prompt tokens of the pooling requests answered",
           _one("pooling_prompt_tokens_total")),
    Metric("inflight_num_backfilled_total", COUNTER,
           "Requests started ahead of a waiting request that did not fit (enable_backfill)", _one("num_backfilled")),
    Metric("inflight_num_requests_rejected_total", COUNTER, "Requests refused at arrival, told when to retry, by "
           "reason (queue_full: max_queue_size requests waiting; ttft_target: the queue could not meet the "
           "request's time-to-first-token target)",
           {"num_rejected_queue_full": {"reason": "queue_full"}, "num_rejected_ttft_target": {"reason": "ttft_target"}},
           ("reason",), rule="counted by the engine as it refuses (docs/configuration.md, \"Overload told early\")"),
    Metric("inflight_spec_decode_num_draft_tokens_total", COUNTER, "Draft tokens verified (speculative_config)",
           _one("spec_decode_num_draft_tokens")),
    Metric("inflight_spec_decode_num_accepted_tokens_total", COUNTER, "Draft tokens accepted (speculative_config)",
           _one("spec_decode_num_accepted_tokens")),
    Metric("inflight_spec_decode_num_failed_proposals_total", COUNTER,
           "Steps whose draft proposal raised and ran without drafts (speculative_config; the log has the error)",
           _one("spec_decode_num_failed_proposals")),
    Metric("inflight_kv_events_dropped_batches_total", COUNTER, "KV-event batches not published: the publisher's "
           "queue was full (the next batch tells subscribers to clear this engine's blocks) or it had stopped "
           "(kv_events_config)", _one("kv_events_dropped")),
    Metric("inflight_kv_events_publisher_failures_total", COUNTER, "Times the KV-event publisher stopped on an error: "
           "no events until a restart (kv_events_config; the log has the error)", _one("kv_events_publisher_failures")),
    Metric("inflight_kv_events_bad_requests_total", COUNTER, "Malformed requests to the KV-event replay socket, "
           "ignored (logged at most once per 10 s)", _one("kv_events_bad_requests")),
    Metric("inflight_time_to_first_token_seconds", HISTOGRAM, "Time to first token", _one("ttft"),
           buckets=(0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0),
           rule="observed by the responder: arrival to the first token"),
    Metric("inflight_inter_token_latency_seconds", HISTOGRAM, "Time between output tokens", _one("itl"),
           buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5),
           rule="observed by the responder, once per token"),
    Metric("inflight_e2e_request_latency_seconds", HISTOGRAM, "Request latency, arrival to last token", _one("e2e"),
           buckets=(0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0),
           rule="observed by the responder when a request ends"),
    Metric("inflight_request_queue_time_seconds", HISTOGRAM, "Time waiting for admission, arrival to first scheduled",
           _one("queue"),
           buckets=(0.0, 0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0),
           rule="observed by the responder at a request's first token"),
    Metric("inflight_spec_decode_acceptance_length", HISTOGRAM,
           "Tokens a sequence got from one verify step: accepted drafts + 1 (speculative_config)",
           _one("spec_decode_acceptance_lengths"), buckets=(1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 24, 33),
           rule="the engine's tally of verify steps by tokens given; what is new is observed"),
    Metric("inflight_cache_config_info", INFO, "KV-cache configuration in the labels: block_size (tokens), "
           "num_gpu_blocks; value 1", _one("cache_config"), ("block_size", "num_gpu_blocks"),
           rule="set once at start: kv_block_size and stats()[\"kv_blocks_total\"]"),
    Metric("inflight_lora_requests_info", INFO, "LoRA adapters with running and waiting requests, and max_lora, in "
           "the labels; value: the Unix time they last changed", _one("lora_info"),
           ("max_lora", "running_lora_adapters", "waiting_lora_adapters"),
           rule="from stats()[\"lora_requests\"] and max_loras, a new series at each change (as vLLM's)", when=LORA),
    Metric("inflight_moe_expert_tokens_total", COUNTER, "Tokens routed to each expert, summed over the MoE layers",
           _one("moe_expert_tokens"), ("expert",), rule="a token counts once per expert it picks", when=MOE),
    Metric("inflight_moe_load_imbalance", GAUGE, "Tokens of the busiest expert over the mean, in the worst MoE layer, "
           "since the last report (1: even)", _one("moe_load_imbalance"), when=MOE),
    Metric("inflight_kv_tier_hits_total", COUNTER, "Prefix blocks started requests found in this tier", _one("hits"),
           ("tier",), when=KV_TIERS, values={"tier": ("device", "host", "disk")}),
    Metric("inflight_kv_tier_misses_total", COUNTER, "Prefix blocks started requests did not find here",
           _one("misses"), ("tier",), when=KV_TIERS, values={"tier": ("device", "host", "disk")}),
    Metric("inflight_kv_tier_bytes_total", COUNTER, "KV bytes a tier moved: load (host: copied back to the device; "
           "disk: read) or store (host: copied from the device; disk: written)",
           {"bytes_loaded": {"direction": "load"}, "bytes_stored": {"direction": "store"}}, ("tier", "direction"),
           when=KV_TIERS, values={"tier": ("host", "disk")}),
    Metric("inflight_kv_tier_failures_total", COUNTER, "Blocks not kept (dropped: every host slot busy; rejected: a "
           "torn or foreign file; write_failed; tampered: a file whose HMAC does not match; unreadable: a folder "
           "entry skipped, a link or another user's file)",
           {"dropped": {"kind": "dropped"}, "rejected": {"kind": "rejected"}, "write_failures": {"kind": "write_failed"},
            "tampered": {"kind": "tampered"}, "unreadable": {"kind": "unreadable"}}, ("tier", "kind"),
           rule="host: dropped; disk: rejected, write_failed, tampered, unreadable", when=KV_TIERS,
           values={"tier": ("host", "disk")}),
    Metric("inflight_kv_tier_choices_total", COUNTER, "Prefix blocks found in this tier that admission chose to "
           "copy back (load) or to compute again (recompute), by kv_tier_load_policy: auto weighs the copy's measured "
           "price against the tokens'", {"load_chosen": {"choice": "load"}, "recompute_chosen": {"choice": "recompute"}},
           ("tier", "choice"), when=KV_TIERS, values={"tier": ("host", "disk")}),
    Metric("inflight_kv_tier_blocks", GAUGE, "KV tier fill in blocks (state: used, total)",
           _states("blocks_", "state", ("used", "total")), ("tier", "state"), when=KV_TIERS,
           values={"tier": ("host", "disk")}),
)

GATEWAY: tuple[Metric, ...] = (
    Metric("inflight_num_requests_running", GAUGE, "Requests in the running batches (all engines of this server)",
           _one("running"), vllm="vllm:num_requests_running", rule="summed over the instances"),
    Metric("inflight_num_requests_waiting", GAUGE, "Requests waiting for admission (all engines of this server)",
           _one("waiting"), vllm="vllm:num_requests_waiting", rule="summed over the instances"),
    Metric("inflight_kv_cache_usage_ratio", GAUGE, "Used share of the KV-cache blocks, 0-1 (1 = full)", _one("usage"),
           vllm="vllm:kv_cache_usage_perc", rule="summed used blocks / summed total blocks"),
    Metric("inflight_kv_blocks", GAUGE, "KV-cache blocks by state (all engines)",
           _states("", "state", ("used", "free", "total")), ("state",), rule="summed over the instances"),
    Metric("inflight_model_instances", GAUGE, "Engine instances summed into these figures", _one("instances"),
           rule="instances with an inflight_num_requests_running series"),
    Metric("inflight_cache_config_info", INFO, "KV-cache configuration in the labels: block_size (tokens), "
           "num_gpu_blocks (all engines)", _one("cache_config"), ("block_size", "num_gpu_blocks"),
           vllm="vllm:cache_config_info", rule="value 1; num_gpu_blocks summed over the instances"),
    Metric("inflight_lora_requests_info", INFO, "LoRA adapters with running and waiting requests, and max_lora, in "
           "the labels; value: the Unix time they last changed", _one("lora_info"),
           ("max_lora", "running_lora_adapters", "waiting_lora_adapters"), vllm="vllm:lora_requests_info",
           rule="each instance's newest series: lists joined, max_lora summed, the latest time", when=LORA),
)


def by_key(table: tuple[Metric, ...]) -> dict[str, Metric]:
    """key -> the metric whose value it is (a key names one metric in a table)."""
    out: dict[str, Metric] = {}
    for m in table:
        for key in m.keys:
            assert key not in out, f"{key} is the key of {out[key].name} and {m.name}"
            out[key] = m
    return out


def metric(name: str, table: tuple[Metric, ...] = TRITON) -> Metric:
    (found,) = [m for m in table if m.name == name]
    return found


def series_names(table: tuple[Metric, ...] = TRITON, when: Iterable[str] = (ALWAYS, LORA, KV_TIERS, MOE)) -> set[str]:
    """Every sample name the table's metrics of these conditions are exported under."""
    return {s for m in table if m.when in set(when) for s in m.series()}


def metric_of_series(name: str, table: tuple[Metric, ...] = TRITON) -> Metric | None:
    """The metric a sample name belongs to (`x_bucket` -> histogram x), or None."""
    return next((m for m in table if name in m.series()), None)


for _table in (TRITON, GATEWAY):
    by_key(_table)
    assert all(m.name.startswith(PREFIX) and m.name == m.name.lower() for m in _table)
    assert len({m.name for m in _table}) == len(_table)
    assert all(set(m.label_values()) <= set(m.labels) for m in _table)
    assert all((m.kind == HISTOGRAM) == bool(m.buckets) for m in _table)

DOC = Path(__file__).resolve().parents[1] / "docs" / "metrics.md"


def _cell(m: Metric, vllm: bool) -> list[str]:
    fixed = m.label_values()
    labels = ", ".join(f"`{k}`" + (f" ({'&#124;'.join(fixed[k])})" if k in fixed else "") for k in m.labels)
    keys = ", ".join(f"`{k}`" for k in m.keys)
    source = f"{keys}: {m.rule}" if m.rule else keys
    when = "always" if m.when == ALWAYS else f"with {m.when}"
    row = [f"`{m.name}`", m.kind, labels, m.help, source, when]
    return row[:1] + [f"`{m.vllm}`" if m.vllm else ""] + row[1:] if vllm else row


def _table(rows: list[list[str]], head: list[str]) -> list[str]:
    return [f"| {' | '.join(head)} |", "|" + " --- |" * len(head)] + [f"| {' | '.join(r)} |" for r in rows]


def markdown() -> str:
    """docs/metrics.md: the table in words."""
    lines = [
        "# Metrics", "",
        "<!-- Written by `python -m templates.metrics` from templates/metrics.py; edit that, not this. -->", "",
        "Every name, label and help text the server exports. Names are never renamed, only added to",
        "([design.md](design.md), \"Contracts\"). The Grafana dashboard (`deploy/grafana/inflight.json`) queries",
        "only these, and the tests check that a live server exports every one it queries.", "",
        "## Triton's metrics port (8002)", "",
        "One series per model instance, each labelled " + ", ".join(f"`{k}`" for k in INSTANCE_LABELS) + ": sum over",
        "`instance` for the server's totals. Source: the `LLMEngine.stats()` key (for the KV tiers, of",
        "`stats()[\"kv_tiers\"][tier]`), or the latency the responder observes. Labels in parentheses take",
        "those values. A histogram is exported as `_bucket`, `_sum` and `_count`. The engine's figures are",
        "written when the model is loaded and then every 0.1 s (at once when a request starts or ends): a",
        "series the engine reports at start (the KV tiers') is there, with its value, once the model is ready.", "",
        *_table([_cell(m, False) for m in TRITON], ["name", "kind", "labels", "help", "source", "exported"]), "",
        "Histogram buckets (upper bounds; `+Inf` too):", "",
        *[f"- `{m.name}`: {', '.join(f'{b:g}' for b in m.buckets)}" for m in TRITON if m.buckets], "",
        "## The OpenAI port's `/metrics`", "",
        "The inference gateway's model-server protocol ([gateway.md](gateway.md)): Triton's series above,",
        "read at each scrape and summed over the served model's instances, each labelled `model_name`, under",
        "our names and vLLM's. Source: the pod's figure.", "",
        *_table([_cell(m, True) for m in GATEWAY], ["name", "vLLM's name", "kind", "labels", "help", "source",
                                                     "exported"]), "",
    ]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    """Write docs/metrics.md (`--check`: exit 1 if the file differs)."""
    text = markdown()
    if "--check" in argv:
        same = DOC.exists() and DOC.read_text() == text
        print(f"{DOC}: {'up to date' if same else 'differs; run python -m templates.metrics'}")
        return 0 if same else 1
    DOC.write_text(text)
    print(f"wrote {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
