"""The metrics table (templates/metrics.py) against real tritonservers running the tiny model, after
a request or two: every series a Grafana dashboard query names is exported on Triton's metrics
port, and the port exports exactly the table's series for the server's settings. Twice: LoRA off
(the session's server), and LoRA on with an adapter and KV tiers (kv_host_cache_bytes), where the
series made only with enable_lora or the tiers exist too. Mixtures of experts are not run here, so
no dashboard query may need one (tests/test_moe_rehearsal.py reads their series)."""

import pytest
from test_metrics_table import dashboard_queries, query_series

from client.grpc_client import GrpcClient
from templates import metrics as table

from . import series
from .conftest import cpu_repository, requires_tritonserver, wait_until

pytestmark = requires_tritonserver
LORA_OFF = (table.ALWAYS,)
LORA_ON = (table.ALWAYS, table.LORA, table.KV_TIERS)


def not_exported(names: set[str], when) -> list[str]:
    """Each dashboard query's series that this server should export and does not, saying which query."""
    out = []
    for title, expr in dashboard_queries():
        for name in sorted(query_series(expr)):
            metric = table.metric_of_series(name)
            if name not in names and (metric is None or metric.when in when):
                out.append(f"panel {title!r}: {expr}\n    names {name}, which the server does not export")
    return out


def check(server, when, requests):
    with GrpcClient(server.grpc_url) as client:
        for options in requests:
            assert client.generate("the metrics table", stream=True, max_tokens=4, **options).token_ids
    want = table.series_names(table.TRITON, when)
    # the engine's first report makes the LoRA info gauge and the tiers' series (every 0.1 s)
    try:
        names = wait_until(lambda: (lambda got: got if want <= got else None)(series.names(server)), timeout=10)
    except AssertionError:
        names = series.names(server)
    missing = not_exported(names, when)
    assert not missing, "\n".join(missing)
    assert names == want, {"in the table, not exported": sorted(want - names),
                           "exported, not in the table": sorted(names - want)}


def test_the_dashboard_needs_no_series_these_runs_cannot_show():
    metrics = [table.metric_of_series(n) for _, expr in dashboard_queries() for n in query_series(expr)]
    conditions = {m.when for m in metrics if m}  # a name not in the table: tests/test_metrics_table.py
    assert conditions <= set(LORA_ON), f"a dashboard query needs {conditions - set(LORA_ON)}: add it to a run here"


def test_lora_off_the_server_exports_the_dashboards_series_and_the_tables(server):
    check(server, LORA_OFF, [{}, {}])


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory, model_path):
    from lora_adapters import AdapterSpec, checkpoint_with_adapters

    from serving.triton_launcher import TritonServer

    folder, _ = checkpoint_with_adapters(model_path, tmp_path_factory.mktemp("metrics-lora"), ("sql",), seed=5,
                                         spec=AdapterSpec(r=8, alpha=16))
    repo = tmp_path_factory.mktemp("metrics-repo")
    cpu_repository(repo)
    params = {"enable_lora": "true", "max_loras": "1", "max_model_len": "512", "kv_host_cache_bytes": str(1 << 20)}
    with TritonServer(repo, params=params, model_path=str(folder)) as srv:
        yield srv


def test_lora_on_the_server_exports_the_dashboards_series_and_the_tables(lora_server):
    check(lora_server, LORA_ON, [{"lora_name": "sql"}, {}])
