"""The import graph of backend/, computed from the source (every import statement, including those
under TYPE_CHECKING and inside functions): no cycle, no file over 300 lines, the model runner takes
only the step contract from scheduling, and scheduling imports nothing above it."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BACKEND = ROOT / "backend"
MAX_LINES = 300
# What scheduling may build on: the data and bookkeeping below it, never the engine above it.
BELOW_SCHEDULING = {"backend.config", "backend.request", "backend.errors", "backend.block_manager", "backend.block_pool",
                    "backend.kv_groups", "backend.outputs"}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def backend_modules() -> dict[str, Path]:
    return {module_name(p): p for p in BACKEND.rglob("*.py")}


def imports_of(path: Path, modules: dict[str, Path]) -> set[str]:
    """The backend modules a file imports (`from backend.x import y` is backend.x.y when that is a
    module, else backend.x)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the file's package
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        found.update(t for t in targets if t in modules and t != name)
    return found


def graph() -> dict[str, set[str]]:
    modules = backend_modules()
    return {name: imports_of(path, modules) for name, path in modules.items()}


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


def test_the_runner_imports_only_the_step_contract_from_scheduling():
    edges = graph()
    assert {m for m in edges["backend.runner"] if m.startswith("backend.sched")} == {"backend.sched.step"}
    assert {m for m in edges["backend.sampler"] if m.startswith("backend.sched")} <= {"backend.sched.step"}
    assert {m for m in edges["backend.warmup"] if m.startswith("backend.sched")} <= {"backend.sched.step"}


def test_scheduling_imports_nothing_above_it():
    """The step contract is data (no backend import at run time beyond the request type); the rest
    of scheduling builds on the config, requests, errors, the block managers (KV-cache groups) and the
    output type."""
    edges = graph()
    sched = {m for m in edges if m.startswith("backend.sched")}
    assert edges["backend.sched.step"] <= {"backend.request"}
    for m in sched:
        above = {t for t in edges[m] if not t.startswith("backend.sched") and t not in BELOW_SCHEDULING}
        assert not above, f"{m} imports {above}"
    users = {m for m, targets in edges.items() if m not in sched and targets & sched}
    # who uses scheduling: the engine (the factory, and the queue reports it makes from the
    # scheduler's state), the runner, its warm-up and the sampler (the step contract), and
    # speculative decoding (the step contract only)
    assert users <= {"backend.engine", "backend.queue_report", "backend.runner", "backend.sampler",
                     "backend.warmup", "backend.spec.rejection", "backend.spec.draft", "backend.spec.speculator"}, users
    for m in ("backend.spec.rejection", "backend.spec.draft", "backend.spec.speculator"):
        assert {t for t in edges[m] if t.startswith("backend.sched")} <= {"backend.sched.step"}, m


def test_the_graph_sees_every_kind_of_import():
    """A mutation check of the reader itself: a TYPE_CHECKING import and a function-local one count."""
    modules = backend_modules()
    assert "backend.request" in imports_of(BACKEND / "sched" / "step.py", modules)  # under TYPE_CHECKING
    assert "backend.sched.factory" in imports_of(BACKEND / "engine.py", modules)
