"""kernels/cpuinfo.py: the one reader of /proc/cpuinfo (model name, flags) and of the cores this
process may run on, which pinning the engine's threads does not narrow."""
from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

from kernels import cpuinfo

ROOT = Path(__file__).resolve().parents[1]
# where code lives (tests/ too: its helpers read the machine's CPU for the golden outputs)
SCANNED = ("backend", "kernels", "client", "openai_server", "serving", "model_repository", "templates", "tests")
NEEDLE = "/proc/" + "cpuinfo"  # spelt in two so this file is not a reader by the scan's own rule
THE_READER = ROOT / "kernels" / "cpuinfo.py"

# A processor of a Zen 3 as Linux 6.x lists it (every one alike): "model" is not the model name,
# "vmx flags" and "bugs" are not the flags.
PROCESSOR = """processor\t: {n}
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 1
model name\t: AMD EPYC 7763 64-Core Processor
flags\t\t: fpu vme sse2 avx avx2 fma f16c bmi2 sha_ni
vmx flags\t: vnmi invvpid ept_x_only
bugs\t\t: sysret_ss_attrs spectre_v1
"""
SAMPLE = "\n".join(PROCESSOR.format(n=n) for n in range(2))


def test_parse_reads_the_model_name_and_the_flags():
    info = cpuinfo.parse(SAMPLE)
    assert info.model == "AMD EPYC 7763 64-Core Processor"
    assert info.flags == frozenset({"fpu", "vme", "sse2", "avx", "avx2", "fma", "f16c", "bmi2", "sha_ni"})


def test_a_cpuinfo_without_them_parses_empty():  # ARM lists "Features", and no model name
    info = cpuinfo.parse("processor\t: 0\nFeatures\t: fp asimd\nCPU implementer\t: 0x41\n")
    assert info.model == "" and info.flags == frozenset()


def test_read_gives_none_where_there_is_no_file(tmp_path):
    assert cpuinfo.read(tmp_path / "nothing") is None
    (tmp_path / "cpuinfo").write_text(SAMPLE)
    assert cpuinfo.read(tmp_path / "cpuinfo") == cpuinfo.parse(SAMPLE)


def test_this_machine_has_a_model_name():
    assert cpuinfo.cpu_model() and isinstance(cpuinfo.cpu_flags(), frozenset)
    if cpuinfo.this_cpu() is not None and cpuinfo.this_cpu().model:
        assert cpuinfo.cpu_model() == cpuinfo.this_cpu().model


def code_strings(path: Path) -> list[tuple[int, str]]:
    """The string constants of a file's code: (line, text), leaving out docstrings and any other
    string that stands alone as a statement (comments are not in the tree at all)."""
    tree = ast.parse(path.read_text(), str(path))
    docs = {id(node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)}
    return [(node.lineno, node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs]


def readers(roots=SCANNED) -> list[str]:
    found = []
    for top in roots:
        for path in sorted((ROOT / top).rglob("*.py")):
            found += [f"{path.relative_to(ROOT)}:{line}" for line, text in code_strings(path) if NEEDLE in text]
    return found


def test_only_kernels_cpuinfo_reads_proc_cpuinfo():
    assert readers() == [f"{THE_READER.relative_to(ROOT)}:{line}"
                         for line, text in code_strings(THE_READER) if NEEDLE in text]
    assert readers(), "the scan no longer sees kernels/cpuinfo.py's own path"


def test_the_scan_sees_code_and_not_docs(tmp_path, monkeypatch):
    """A mutation check of the scan: a reader in code is found, in a docstring or a comment not."""
    for top in ("a", "b"):
        (tmp_path / top).mkdir()
    (tmp_path / "a" / "doc.py").write_text(f'"""reads {NEEDLE}"""\n# {NEEDLE}\ndef f():\n    """{NEEDLE}"""\n')
    (tmp_path / "b" / "reader.py").write_text(f'"""A module."""\nTEXT = open(f"{NEEDLE}").read()\n')
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert readers(("a", "b")) == [f"b{os.sep}reader.py:2"]


PIN = """
import os, sys
start = sorted(os.sched_getaffinity(0))
from kernels.cpuinfo import allowed_cores
os.sched_setaffinity(0, {start[-1]})  # as the engine pins its thread (backend/worker/cpu_affinity.py)
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "backend", "numpy"))
print(start, sorted(os.sched_getaffinity(0)), allowed_cores(), heavy)
"""


def test_pinning_the_thread_leaves_allowed_cores_as_at_start():
    """What sizes a pool of threads (xgrammar's, a second engine's) after the engine pinned its own
    thread to one core: every core the process had. On a 1-core machine, that one core."""
    out = subprocess.run([sys.executable, "-c", PIN], capture_output=True, text=True, cwd=ROOT, timeout=60,
                         check=True).stdout.strip()
    start = sorted(os.sched_getaffinity(0))
    assert out == f"{start} {start[-1:]} {start} []"  # and kernels.cpuinfo loaded no torch, numpy or backend


def test_cpu_affinity_serves_the_same_allowed_cores():
    from backend.worker import cpu_affinity
    assert cpu_affinity.allowed_cores is cpuinfo.allowed_cores
