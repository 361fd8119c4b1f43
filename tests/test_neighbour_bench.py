"""client/tools/benchmarks/neighbour.py on the tiny model: its turns in the order idle spin stream
stream spin idle, each busy neighbour really ran on its CPU beside the decodes, and the summary is
each kind's median over idle's."""
import json

from client.tools.benchmarks import neighbour


def test_the_neighbour_tool_times_decode_beside_each_kind_of_neighbour(default_model_dir, tmp_path):
    out = tmp_path / "n.json"
    assert neighbour.main(["--model-path", str(default_model_dir), "--decode", "6", "--rounds", "1",
                           "--repeats", "2", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    turns = result["turns"]
    assert [t["kind"] for t in turns] == ["idle", "spin", "stream", "stream", "spin", "idle"]
    for t in turns:
        assert len(t["values"]) == 2 and all(v > 0 for v in t["values"])
        # a busy neighbour ran through its turn (the second it is given to start, then the decodes: a
        # quarter of that even on a loaded CI machine); one that failed shows an interpreter's start-up
        assert (t["neighbour_cpu_s"] > 0.25 * (1.0 + t["wall_s"])) == (t["kind"] != "idle"), t
    assert result["summary"]["idle"]["vs_idle"] == 1.0
    for kind in ("spin", "stream"):
        med = sorted(t["decode_ms"] for t in turns if t["kind"] == kind)
        s = result["summary"][kind]
        assert s["median_ms"] == round(sum(med) / 2, 4)
        assert abs(s["vs_idle"] - s["median_ms"] / result["summary"]["idle"]["median_ms"]) < 1e-3
