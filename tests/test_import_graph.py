"""The import graph of backend/, computed from the source (every import statement, including those
under TYPE_CHECKING and inside functions): packages by layer, imports one way (LAYERS), no cycle, no
file over 300 lines, no package reaching into another's private names, and every package saying
what it owns; and outside backend/, nothing that serves imports a tool."""
from __future__ import annotations

import ast
from pathlib import Path

from client.tools.docs.import_map import (  # the one reading of the graph, shared with docs/design.md's map
    BACKEND, LAYERS, ROOT, backend_modules, graph, imports_of, module_name)

MAX_LINES = 300


def find_cycle(edges: dict[str, set[str]]) -> list[str]:
    """One import cycle as a path (first module repeated at the end), or []."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        state[node] = 2
        path.pop()
        return []

    for node in sorted(edges):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return []


def test_backend_has_no_import_cycle():
    cycle = find_cycle(graph())
    assert not cycle, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) == []


def test_no_backend_file_is_over_300_lines():
    long = {str(p.relative_to(ROOT)): n for p in BACKEND.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"files over {MAX_LINES} lines: {long}"


def layer_of(module: str) -> int:
    return LAYERS.index(module.split(".")[1])


def test_backend_root_holds_only_its_init_and_the_layer_packages():
    assert sorted(p.name for p in BACKEND.glob("*.py")) == ["__init__.py"]
    packages = {p.name for p in BACKEND.iterdir() if (p / "__init__.py").exists()}
    assert packages == set(LAYERS), packages ^ set(LAYERS)


def test_imports_go_one_way():
    """core < text < kv < sched < models < worker < speculative < engine: no module imports a
    package above its own. `backend/__init__.py` (the public API, exported lazily) is the one
    exception, the top of everything."""
    wrong = {}
    for m, targets in graph().items():
        if m == "backend":
            continue
        up = sorted(t for t in targets if t != "backend" and layer_of(t) > layer_of(m))
        if up:
            wrong[m] = up
    assert not wrong, "imports against the layers: " + "; ".join(f"{m} -> {', '.join(t)}" for m, t in wrong.items())


def test_the_layer_check_catches_an_upward_import():
    assert layer_of("backend.worker.runner") > layer_of("backend.sched.scheduler") > layer_of("backend.core.step")
    edges = {"backend.sched.scheduler": {"backend.worker.runner"}}
    assert [m for m, t in edges.items() if any(layer_of(x) > layer_of(m) for x in t)] == ["backend.sched.scheduler"]


def private_imports(path: Path, modules: dict[str, Path]) -> list[str]:
    """`from backend.<pkg>... import _name` where <pkg> is not the file's own package."""
    own = module_name(path).split(".")[1] if module_name(path) != "backend" else ""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").startswith("backend."):
            if node.module.split(".")[1] != own:
                found += [f"{node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
    return found


def test_no_package_imports_another_packages_private_names():
    modules = backend_modules()
    bad = {str(p.relative_to(ROOT)): names for p in BACKEND.rglob("*.py") if (names := private_imports(p, modules))}
    assert not bad, bad


def test_every_package_says_what_it_owns():
    """Each package's __init__ opens with a docstring naming what it owns (a sentence at least)."""
    for init in BACKEND.rglob("__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert len(doc.split()) >= 8, f"{init.relative_to(ROOT)} says too little of what it owns: {doc!r}"


def test_nothing_that_serves_imports_a_tool():
    """client/tools/ builds on everything; nothing outside client/ may import it (the server, the
    OpenAI door, the engine, the kernels, the model repository's code)."""
    offenders = []
    for top in ("backend", "kernels", "serving", "openai_server", "templates", "model_repository"):
        for path in (ROOT / top).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                    [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
                if any(n == "client.tools" or n.startswith("client.tools.") for n in names):
                    offenders.append(str(path.relative_to(ROOT)))
    assert not offenders, offenders


def test_the_kernels_import_nothing_of_the_engine():
    for path in (ROOT / "kernels").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("backend"):
                raise AssertionError(f"{path.relative_to(ROOT)} imports {node.module}")
            if isinstance(node, ast.Import) and any(a.name.startswith("backend") for a in node.names):
                raise AssertionError(f"{path.relative_to(ROOT)} imports backend")


def test_the_graph_sees_every_kind_of_import():
    """A mutation check of the reader itself: a TYPE_CHECKING import and a function-local one count."""
    modules = backend_modules()
    assert "backend.core.sampling_params" in imports_of(BACKEND / "core" / "step.py", modules)  # under TYPE_CHECKING
    assert "backend.sched.factory" in imports_of(BACKEND / "engine" / "wiring.py", modules)
