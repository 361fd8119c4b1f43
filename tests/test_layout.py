"""The repository's layout promises: nothing in client/ shadows another module, and the engine's
torch-free modules stay torch-free at import time."""
import sys


def test_no_client_module_shadows_another_top_level_module():
    """Tools that run a file in client/ by path (locust -f client/tools/load/locustfile.py, python
    client/x.py) put client/ first on sys.path: a client/grpc.py or client/http.py would then be
    imported in place of grpc or the standard library's http."""
    import importlib.util
    from pathlib import Path

    import client

    root = Path(client.__file__).parent
    for path in root.rglob("*.py"):  # client/ and its tools/, each first on sys.path when run by path
        name = path.stem
        if name in ("__init__", "__main__"):
            continue
        where = path.relative_to(root.parent)
        assert name not in sys.stdlib_module_names, f"{where} shadows the stdlib's {name}"
        assert importlib.util.find_spec(name) is None, f"{where} shadows the installed {name}"


def test_engine_seams_import_neither_torch_nor_triton():
    """The config, request, scheduling and block-keeping modules load without torch or triton, so a
    bad config.pbtxt is refused before the heavy libraries load (and these stay testable alone)."""
    import subprocess

    modules = ["backend.core.config", "backend.core.request", "backend.sched.factory", "backend.kv.block_manager",
               "backend.core.step", "backend.core.errors", "backend.worker.parent_watch", "backend.kv.sizing",
               "backend.worker.warmup", "backend", "backend.core.speculative_config", "backend.sched.speculation"]
    code = ("import sys\n" + "".join(f"import {m}\n" for m in modules) +
            "heavy = sorted(m for m in ('torch', 'triton', 'numpy') if m in sys.modules)\n"
            "print(','.join(heavy))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"importing {modules} loaded {out.stdout.strip()}"


def test_the_ngram_proposer_loads_no_torch():
    """Prompt lookup is plain token matching (numpy): it must not pull torch in."""
    import subprocess

    code = "import sys, backend.speculative.ngram\nprint('torch' in sys.modules)\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_no_source_or_document_holds_a_merge_conflict_marker():
    """A merge resolved by hand once left README.md with both sides and the markers between them;
    nothing the repository ships (sources, docs, configs) may hold one."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    skip = {".git", ".venv", "models", "__pycache__", ".hypothesis", ".pytest_cache", "inflight.egg-info"}
    suffixes = {".py", ".md", ".c", ".h", ".pbtxt", ".toml", ".txt", ".yaml", ".yml", ".sh", ".jinja", ".cfg"}
    checked, marked = 0, []

    def walk(folder: Path):
        for path in folder.iterdir():
            if path.is_dir() and path.name not in skip and not path.is_symlink():
                yield from walk(path)
            elif path.is_file() and (path.suffix in suffixes or path.name in ("Makefile", "Dockerfile")):
                yield path

    for path in walk(root):
        checked += 1
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if line.startswith(("<<<<<<< ", ">>>>>>> ")):  # ("=======" can underline a heading)
                marked.append(f"{path.relative_to(root)}:{n}")
    assert checked > 100 and not marked, marked
