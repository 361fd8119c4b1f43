"""`python -m client.tools.gpu_check` runs from a source checkout on a bare GPU image whose packages
are torch, triton, transformers, peft, numpy, safetensors and what they bring (tokenizers, jinja2,
psutil, tqdm, huggingface_hub, accelerate, PyYAML): no xgrammar, tritonclient, tritonserver,
fastapi, uvicorn, gguf, pyzmq or matplotlib. So nothing that gpu-check imports when it loads (the
modules it imports at module level, transitively, and all of backend/ and kernels/, which its parts
load) imports another package at module level; the parts that need one import it inside, and are
skipped where it is missing. Computed from the source: every import statement outside functions and
classes (inside `if`/`try` too), but `if TYPE_CHECKING:` blocks. `make test-compat` runs the check
itself in a venv of that package set."""
from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROJECT = ("backend", "kernels", "client", "templates", "openai_server")
IMAGE = {"torch", "triton", "transformers", "peft", "numpy", "safetensors", "tokenizers", "jinja2", "psutil",
         "tqdm", "huggingface_hub", "accelerate", "yaml", "packaging", "filelock", "fsspec", "regex", "sympy",
         "networkx", "typing_extensions"}
ENTRY = ["client.tools.gpu_check.run", "client.tools.gpu_check.plan", "client.tools.gpu_check.report",
         "client.tools.gpu_check.compile", "client.tools.gpu_check.greedy", "client.tools.gpu_check.engine",
         "client.tools.gpu_check.structured", "client.tools.gpu_check.beams", "client.tools.gpu_check.tp", "client.tools.gpu_check.served",
         "client.tools.benchmarks.kernel_bench", "client.cli"]


def path_of(module: str) -> Path | None:
    base = ROOT.joinpath(*module.split("."))
    for p in (base.with_suffix(".py"), base / "__init__.py"):
        if p.is_file():
            return p
    return None


def module_level_imports(path: Path) -> set[str]:
    """Absolute module names imported by the file's module-level statements."""
    found: set[str] = set()
    package = ".".join(path.relative_to(ROOT).parent.parts)   # what a relative import starts from

    def visit(body):
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                visit(node.orelse)
                continue
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                found.add(base)
                found.update(f"{base}.{a.name}" for a in node.names if path_of(f"{base}.{a.name}"))
            for field in ("body", "orelse", "finalbody", "handlers"):
                visit(getattr(node, field, []) or [])

    visit(ast.parse(path.read_text(), str(path)).body)
    return found


def external_imports_at_load() -> dict[str, set[str]]:
    """External top-level package -> the project files that import it at module level."""
    todo = list(ENTRY) + [".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
                          for d in ("backend", "kernels") for p in (ROOT / d).rglob("*.py")]
    seen, external = set(), {}
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        path = path_of(module)
        if path is None:
            continue
        for name in module_level_imports(path):
            top = name.split(".")[0]
            if top in PROJECT:
                todo.append(name)
            elif top not in sys.stdlib_module_names and top != "__future__":
                external.setdefault(top, set()).add(str(path.relative_to(ROOT)))
    return external


def test_what_gpu_check_loads_imports_only_the_images_packages():
    external = external_imports_at_load()
    assert {"torch", "triton", "numpy", "safetensors"} <= set(external)   # the scan sees imports
    outside = {pkg: sorted(files) for pkg, files in external.items() if pkg not in IMAGE}
    assert not outside, f"imported at module level, missing on a bare GPU image: {outside}"


def test_the_scan_finds_a_module_level_import_of_a_missing_package(tmp_path, monkeypatch):
    """A module-level `import tritonclient` in a project file gpu-check loads would be reported;
    one inside a function or under TYPE_CHECKING would not."""
    fake = tmp_path / "client" / "tools"
    (fake / "gpu_check").mkdir(parents=True)
    (fake / "gpu_check" / "run.py").write_text("import torch\nfrom client.tools import helper\n")
    (fake / "helper.py").write_text("import tritonclient.grpc\nfrom typing import TYPE_CHECKING\n"
                                    "if TYPE_CHECKING:\n    import fastapi\ndef f():\n    import gguf\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    monkeypatch.setattr(sys.modules[__name__], "ENTRY", ["client.tools.gpu_check.run"])
    assert external_imports_at_load() == {"torch": {"client/tools/gpu_check/run.py"},
                                          "tritonclient": {"client/tools/helper.py"}}
