"""Two versions of the engine measured in turns: this checkout and git REF's, each run of a benchmark
module in its own process, in the order A B B A per round, so that a shared machine's drift hits
both alike. REF's tree is extracted to a temporary folder and given this checkout's copy of the
benchmark (which must use only what both versions have)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def ab_runs(ref: str, module: str, argv: list[str], rounds: int) -> dict[str, list[dict]]:
    """{"before": [...], "after": [...]}: each run's JSON (`--json FILE` of `python -m module`)."""
    results: dict[str, list[dict]] = {"before": [], "after": []}
    source = ROOT / (module.replace(".", "/") + ".py")
    with tempfile.TemporaryDirectory() as tmp:
        before = Path(tmp) / "before"
        before.mkdir()
        archive = subprocess.run(["git", "archive", ref], cwd=ROOT, capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(before)], input=archive, check=True)
        copy = before / source.relative_to(ROOT)
        for package in copy.relative_to(before).parents:  # older layouts: the packages may be missing
            if package != Path(".") and not (before / package / "__init__.py").exists():
                (before / package).mkdir(parents=True, exist_ok=True)
                (before / package / "__init__.py").touch()
        copy.write_bytes(source.read_bytes())
        for i, who in enumerate(["before", "after", "after", "before"] * rounds):
            out = Path(tmp) / f"{i}.json"
            tree = before if who == "before" else ROOT
            subprocess.run([sys.executable, "-m", module, *argv, "--json", str(out)], check=True, cwd=tree,
                           env=dict(os.environ, PYTHONPATH=str(tree)), stdout=subprocess.DEVNULL)
            results[who].append(json.loads(out.read_text()))
    return results
