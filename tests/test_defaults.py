"""backend/core/defaults.py is the one place of each default a request may leave out: every door
(the Python API's SamplingParams, the Triton adapter, the OpenAI completions endpoint) and the
tensor table's doc take max_tokens' default from it, and no other source writes the number."""
from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

from backend.core import defaults

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("backend", "kernels", "client", "openai_server", "serving", "model_repository", "templates")
THE_PLACE = ROOT / "backend" / "core" / "defaults.py"
# A tool's own choice that happens to be the number, not a request's default: file -> why
TOOL_CHOICES = {"client/tools/benchmarks/kv_cache_figure.py": "the figure's simulated request; its numbers are "
                                                             "in docs/ and must not move with the default"}

# Another default, set before the doors are imported: each must follow it.
DOORS = """
import json, sys
sys.path.insert(0, "model_repository/llm/1")  # where Triton's stub finds triton_inputs
from backend.core import defaults
defaults.MAX_TOKENS = 7919
import numpy as np
from templates import tensors
import triton_inputs
from openai_server.translate import parse_completion
from backend.core.sampling_params import SamplingParams
print(json.dumps({
    "tensor doc": next(t.doc for t in tensors.INPUTS if t.name == "max_tokens"),
    "triton": triton_inputs.parse_request({"input_ids": np.array([1, 2], dtype=np.int32)}).params.max_tokens,
    "openai completions": parse_completion({"model": "llm", "prompt": "Hi"}).sampling["max_tokens"],
    "python": SamplingParams().max_tokens,
}))
"""


def test_every_door_takes_max_tokens_from_defaults():
    done = subprocess.run([sys.executable, "-c", DOORS], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.splitlines()[-1]) == {
        "tensor doc": "default 7919; >= 1", "triton": 7919, "openai completions": 7919, "python": 7919}


def max_tokens_defaults(path: Path, value: int) -> list[int]:
    """Lines where a file sets a max_tokens default to `value`: a name or field named *max_tokens*
    assigned it, a parameter named so defaulting to it, `setdefault`/`get("max_tokens", value)`, or
    a string saying "default <value>" in a call that names max_tokens (the tensor table's rows)."""
    hits = []

    def named(node) -> bool:
        name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
        return "max_tokens" in name.lower()

    def is_value(node) -> bool:
        return isinstance(node, ast.Constant) and type(node.value) is int and node.value == value

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Assign) and is_value(node.value) and any(named(t) for t in node.targets):
            hits.append(node.lineno)
        elif isinstance(node, ast.AnnAssign) and node.value is not None and is_value(node.value):
            hits += [node.lineno] if named(node.target) else []
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            args = node.args.posonlyargs + node.args.args
            pairs = list(zip(args[len(args) - len(node.args.defaults):], node.args.defaults))
            pairs += [(a, d) for a, d in zip(node.args.kwonlyargs, node.args.kw_defaults) if d is not None]
            hits += [d.lineno for a, d in pairs if "max_tokens" in a.arg.lower() and is_value(d)]
        elif isinstance(node, ast.Call):
            consts = [a.value for a in node.args if isinstance(a, ast.Constant)]
            if "max_tokens" in consts and (any(is_value(a) for a in node.args) or any(
                    isinstance(c, str) and f"default {value};" in c for c in consts)):
                hits.append(node.lineno)
    return sorted(hits)


def scan(roots=SOURCES, value: int = defaults.MAX_TOKENS) -> list[str]:
    return [f"{path.relative_to(ROOT)}:{line}" for top in roots for path in sorted((ROOT / top).rglob("*.py"))
            for line in max_tokens_defaults(path, value)]


def test_no_source_but_defaults_writes_the_number():
    own = [f"{THE_PLACE.relative_to(ROOT)}:{line}" for line in max_tokens_defaults(THE_PLACE, defaults.MAX_TOKENS)]
    assert [hit for hit in scan() if hit.partition(":")[0] not in TOOL_CHOICES] == own
    assert scan(), "the scan no longer sees defaults.py's own MAX_TOKENS"


def test_the_scan_sees_each_way_of_writing_a_default(tmp_path, monkeypatch):
    """A mutation check of the scan: the ways the doors wrote 16 before defaults.py, found; a call
    asking for 16 tokens (a tool's choice, not a default) is not."""
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "doors.py").write_text(
        "DEFAULT_MAX_TOKENS = 16\n"
        "class P:\n    max_tokens: int = 16\n"
        "def f(prompt, max_tokens=16):\n    pass\n"
        "sampling = {}\nsampling.setdefault('max_tokens', 16)\n"
        "row = Tensor('max_tokens', 'INT32', (1,), 'default 16; >= 1', 'max_tokens')\n"
        "run(max_tokens=16)\nDEFAULT_MAX_TOKENS = 17\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert scan(("src",), 16) == [f"src/doors.py:{n}" for n in (1, 3, 4, 7, 8)]
