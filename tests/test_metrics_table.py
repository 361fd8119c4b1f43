"""The metrics table (templates/metrics.py) is where every name comes from: the Triton custom metrics
model.py makes are its TRITON entries (names, help texts, kinds, labels, buckets), the OpenAI port's
/metrics serves its GATEWAY entries, every Grafana query names only its series with their labels,
docs/metrics.md is written from it, and the docs and deployment files name no metric outside it.
That a live server exports what the dashboard queries: tests/e2e/test_metrics_served.py."""
import json
import re
import sys
import types
from pathlib import Path

from templates import metrics as table

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "deploy" / "grafana" / "inflight.json"
MODEL_DIR = ROOT / "model_repository" / "llm" / "1"
# PromQL words that are not series; what Prometheus adds to a scraped series (pod) and `le` (buckets)
PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
                "offset"}
SCRAPE_LABELS = {"pod", "namespace", "job"}


def dashboard_queries(path: Path = DASHBOARD) -> list[tuple[str, str]]:
    """(panel title, PromQL) for every target of the dashboard."""
    dashboard = json.loads(path.read_text())
    return [(p["title"], t["expr"]) for p in dashboard["panels"] for t in p.get("targets", [])]


def query_selectors(expr: str) -> list[tuple[str, dict[str, str]]]:
    """The series a PromQL expression selects: (name, {label: value} of its matchers)."""
    bare = re.sub(r"\[[^\]]*\]", "", expr)  # ranges: [5m], [$__rate_interval]
    bare = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", bare)
    out = []
    for m in re.finditer(r"(?<![\w.:])([a-zA-Z_:][a-zA-Z0-9_:]*)\s*(\{[^}]*\})?(\s*\()?", bare):
        name, matchers, call = m.groups()
        if not call and name not in PROMQL_WORDS:
            out.append((name, dict(re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*=~?\s*"([^"]*)"', matchers or ""))))
    return out


def query_series(expr: str) -> set[str]:
    return {name for name, _ in query_selectors(expr)}


def _by_labels(expr: str) -> set[str]:
    groups = re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", expr)
    return {label.strip() for group in groups for label in group.split(",")}


def dashboard_problems(queries: list[tuple[str, str]]) -> list[str]:
    """What a query names that the table has not: a series, a label, a label value."""
    problems = []
    for title, expr in queries:
        metrics = []
        for name, matchers in query_selectors(expr):
            metric = table.metric_of_series(name)
            if metric is None:
                problems.append(f"{title!r}: {expr} names {name}, not in templates/metrics.py's TRITON")
                continue
            metrics.append(metric)
            fixed = metric.label_values()
            for label, value in matchers.items():
                if label not in metric.labels + table.INSTANCE_LABELS:
                    problems.append(f"{title!r}: {expr}: {name} has no label {label}")
                elif fixed.get(label) and value not in fixed[label]:
                    problems.append(f"{title!r}: {expr}: {name}{{{label}}} is never {value!r}")
        known = set(table.INSTANCE_LABELS) | SCRAPE_LABELS
        for label in _by_labels(expr) - known:
            if not all(label in m.labels or (label == "le" and m.kind == table.HISTOGRAM) for m in metrics):
                problems.append(f"{title!r}: {expr} groups by {label}, a label not every series in it has")
    return problems


def test_every_dashboard_query_names_only_series_of_the_table():
    queries = dashboard_queries()
    assert len(queries) > 20 and all(query_series(expr) for _, expr in queries)
    assert dashboard_problems(queries) == []


def test_the_dashboard_check_sees_a_wrong_name_label_or_value():
    """The check itself, on queries broken as a rename would break them."""
    good = 'sum(rate(inflight_kv_tier_bytes_total{tier="host"}[5m])) / sum(inflight_kv_blocks{state="used"})'
    assert query_series(good) == {"inflight_kv_tier_bytes_total", "inflight_kv_blocks"}
    assert query_series("histogram_quantile(0.5, sum by (le) (rate(x_bucket[$__rate_interval])))") == {"x_bucket"}
    assert dashboard_problems([("ok", good)]) == []
    bad = [("a", "sum(inflight_num_requests_runing)"), ("b", 'sum(inflight_kv_blocks{state="use"})'),
           ("c", 'sum(inflight_kv_blocks{adapter="x"})'), ("d", "sum by (tier) (inflight_kv_blocks)"),
           ("e", "sum(rate(inflight_time_to_first_token_seconds_buckets[5m]))"),
           ("f", "sum(vllm:num_requests_running)"),
           ("g", 'sum by (adapter) (inflight_lora_requests{state="runing"})')]
    assert [p.split(":")[0] for p in dashboard_problems(bad)] == ["'a'", "'b'", "'c'", "'d'", "'e'", "'f'", "'g'"]


def test_docs_metrics_md_is_written_from_the_table():
    assert table.DOC.read_text() == table.markdown(), "docs/metrics.md is stale: run python -m templates.metrics"
    for m in table.TRITON + table.GATEWAY:
        assert f"`{m.name}`" in table.DOC.read_text()


def test_the_docs_and_deployment_name_only_metrics_of_the_table():
    """README, docs/*.md (design.md's "Contracts" among them), the manifests and the dashboard name no
    metric the table lacks, so a name dropped from the table (renamed) fails here. `inflight_x_*`
    (a family of names) must start some."""
    names = table.series_names(table.TRITON) | table.series_names(table.GATEWAY)
    names |= {m.name for m in table.TRITON + table.GATEWAY}  # a histogram's own name
    files = [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "deploy").rglob("*.yaml"), DASHBOARD]
    unknown = []
    for path in files:
        for name in set(re.findall(r"\b(inflight_[a-z0-9_]+|vllm:[a-z0-9_:]+)", path.read_text())):
            if name not in names and not (name.endswith("_") and any(n.startswith(name) for n in names)):
                unknown.append(f"{path.relative_to(ROOT)}: {name}")
    assert unknown == []


class _Family:
    GAUGE, COUNTER, HISTOGRAM = "gauge", "counter", "histogram"

    def __init__(self, name, description, kind):
        self.name, self.description, self.kind, self.metrics = name, description, kind, []
        self.made.append(self)

    def Metric(self, labels, buckets=None):  # noqa: N802 (pb_utils' name)
        metric = types.SimpleNamespace(labels=dict(labels), buckets=buckets, set=lambda v: None,
                                       increment=lambda v: None, observe=lambda v: None)
        self.metrics.append(metric)
        return metric


STATS = {"num_requests_running": 1, "num_requests_waiting": 0, "kv_blocks_total": 8, "kv_blocks_used": 2,
         "kv_blocks_free": 6, "kv_blocks_reserved": 1, "lora_requests": {"sql": {"running": 1, "waiting": 0}},
         "lora_loads_total": 1, "lora_unloads_total": 0,  # an engine with LoRA reports them
         "moe_expert_tokens": [3, 4], "moe_load_imbalance": 1.1, "spec_decode_acceptance_lengths": [1, 1],
         "kv_tiers": {"device": {"hits": 1, "misses": 1},
                      "host": {"hits": 1, "misses": 0, "bytes_loaded": 1, "bytes_stored": 1, "dropped": 0,
                               "load_chosen": 1, "recompute_chosen": 0, "blocks_used": 1, "blocks_total": 4},
                      "disk": {"hits": 0, "misses": 1, "bytes_loaded": 0, "bytes_stored": 1, "rejected": 0,
                               "write_failures": 0, "load_chosen": 0, "recompute_chosen": 1, "blocks_used": 1,
                               "blocks_total": 4}}}


def test_the_triton_metrics_are_the_tables(monkeypatch):
    """Every family triton_metrics.py makes (with LoRA, experts and tiers reported) is a TRITON entry
    with its help text and kind, each series has the entry's labels (values as its keys fix them),
    each histogram its buckets; and every entry is made."""
    monkeypatch.syspath_prepend(str(MODEL_DIR))
    monkeypatch.delitem(sys.modules, "triton_metrics", raising=False)
    from triton_metrics import Metrics

    _Family.made = []
    metrics = Metrics({"model": "llm", "version": "1", "instance": "llm_0_0", "device": "cpu"}, _Family)
    metrics.describe(16, 8, 2)
    metrics.update(STATS)
    kinds = {table.GAUGE: "gauge", table.INFO: "gauge", table.COUNTER: "counter", table.HISTOGRAM: "histogram"}
    assert [f.name for f in _Family.made] == [m.name for m in table.TRITON]
    for family in _Family.made:
        entry = table.metric(family.name)
        assert (family.description, family.kind) == (entry.help, kinds[entry.kind]), family.name
        assert family.metrics, family.name
        for metric in family.metrics:
            assert tuple(metric.labels) == table.INSTANCE_LABELS + entry.labels, family.name
            assert all(metric.labels[k] in v for k, v in entry.label_values().items()), (family.name, metric.labels)
            assert metric.buckets == (list(entry.buckets) if entry.buckets else None), family.name


def test_the_openai_port_serves_the_gateway_table():
    """Every GATEWAY entry under its name and vLLM's, with its help text and labels; nothing else."""
    from openai_server.metrics import PodFigures, parse_exposition, render

    figures = PodFigures(2, 1, 3, 4, 10, block_size="16",
                         blocks={"used": 4, "free": 6, "total": 10, "num_gpu_blocks": 10},
                         lora={"max_lora": 2, "running": ["sql"], "waiting": [], "updated": 5.0})
    text = render(figures, "llm")
    served = {}
    for sample in parse_exposition(text):
        served.setdefault(sample.name, set()).add(tuple(sample.labels))
    want = {}
    for m in table.GATEWAY:
        for name in m.series():
            want[name] = {table.GATEWAY_LABELS + m.labels}
            assert f"# HELP {name} {m.help}\n" in text
    assert served == want
    assert table.series_names(table.GATEWAY, [table.ALWAYS]) == {
        s.name for s in parse_exposition(render(PodFigures(1, 0, 0, 0, 1, block_size="16", blocks={
            "used": 0, "free": 1, "total": 1, "num_gpu_blocks": 1}), "llm"))}   # no LoRA: no lora_requests_info
