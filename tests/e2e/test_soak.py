"""The soak's short version (`make soak` runs the same for 2 minutes): 12 seconds of Locust load on a
tritonserver the soak driver starts on loopback, with requests cancelled at random. Nothing that was
not cancelled may fail, every request must be accounted for, the KV blocks must all come back, and
resident memory must not grow by 10% from the first to the last window."""
import json

from client.tools.load import soak
from .conftest import requires_tritonserver

pytestmark = requires_tritonserver


def test_a_12_second_soak_loses_nothing_and_leaks_nothing(model_repository, model_path, tmp_path, capsys):
    report = soak.run(duration=12, max_num_seqs=4, cancel=0.15, max_tokens=48,
                      params={"max_model_len": "2048"}, model_repository=model_repository,
                      model_path=str(model_path), workdir=tmp_path, seed=3)
    print(soak.summary(report))
    (tmp_path / "report.json").write_text(json.dumps(report, indent=1))
    r = report["requests"]
    assert report["users"] == 8  # 2 x max_num_seqs
    assert r["failed"] == 0, report["failures"]
    assert r["in_flight"] == 0 and r["completed"] + r["cancelled"] + r["rejected"] == r["sent"]
    assert r["completed"] >= 20 and r["cancelled"] >= 1
    # every client path ran, and every way of cancelling was used at least once over the run
    assert set(report["by_user"]) == {"grpc stream", "http generate", "http stream"}
    assert report["kv_blocks_used_end"] == 0 and report["peak_kv_blocks_used"] > 0
    assert report["memory"]["growth"] < soak.GROWTH_LIMIT
    assert report["passed"], soak.summary(report)
