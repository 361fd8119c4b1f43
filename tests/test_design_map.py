"""docs/design.md's map is current: the edges listed beside the picture (docs/design_map.txt) are
the package-level import graph of the source now, so a new import between packages fails here until
the map is regenerated (`python -m client.tools.docs.import_map`), and every edge goes down the
layers. Plain ast reading: no torch, no matplotlib."""
from client.tools.docs.import_map import (DEFAULT_OUT, NODES, ROOT, edges_text, module_counts, package_graph, rank,
                                          sorted_edges)

REGENERATE = "python -m client.tools.docs.import_map"
LISTING = ROOT / DEFAULT_OUT.with_suffix(".txt")


def edge_lines(text: str) -> set[str]:
    return {line for line in text.splitlines() if line.strip()}


def test_the_checked_in_map_is_the_import_graph_now():
    now = edges_text(package_graph())
    listed = LISTING.read_text()
    added, gone = sorted(edge_lines(now) - edge_lines(listed)), sorted(edge_lines(listed) - edge_lines(now))
    assert listed == now, (f"docs/design_map.txt is stale (new edges: {added}; edges gone: {gone}): run `{REGENERATE}` "
                           "and describe the change in docs/design.md's Map")


def test_every_edge_goes_down_the_layers():
    """kernels < core < text < kv < sched < models < worker < speculative < engine < doors."""
    edges = package_graph()
    up = [f"{a} -> {b}" for a, b in sorted_edges(edges) if rank(a) <= rank(b)]
    assert not up, f"imports against the layers: {up}"
    for line in edge_lines(LISTING.read_text()):
        a, arrow, b = line.split(" ")
        assert arrow == "->" and rank(a) > rank(b), line


def test_the_map_sees_the_known_edges():
    """A check of the reader: edges the code is built on, kernels' users and the doors are seen."""
    edges = package_graph()
    assert {"sched", "worker", "speculative"} <= edges["engine"]
    assert "kernels" in edges["models"] and "kernels" in edges["worker"]
    assert {"core", "engine"} <= edges["doors"]
    assert not edges["core"] and not edges["kernels"]
    assert set(edges) == set(NODES)
    assert all(count > 0 for count in module_counts().values())


def test_design_md_shows_the_map_and_how_to_regenerate_it():
    design = (ROOT / "docs" / "design.md").read_text()
    assert (ROOT / DEFAULT_OUT).exists() and f"]({DEFAULT_OUT.name})" in design and REGENERATE in design
