"""client/tools/benchmarks/sass_stats.py: static SASS counts of the quantized GEMMs, compiled for
sm_90 with no GPU here."""
import json
import os
import subprocess
import sys
from pathlib import Path

from client.tools.benchmarks.sass_stats import sass_counts

ROOT = Path(__file__).resolve().parents[2]

LISTING = """
        /*0000*/                   LDC R1, c[0x0][0x28] ;                /* 0x00000a00ff017b82 */
        /*0010*/                   LDG.E.U8 R4, desc[UR4][R2.64] ;        /* 0x0000000402047981 */
        /*0020*/               @P0 LDG.E.128 R8, desc[UR4][R6.64] ;       /* 0x0000000406080981 */
        /*0030*/              @!P1 FFMA R5, R4, R3, R5 ;                  /* 0x0000000304059223 */
        /*0040*/                   EXIT ;                                 /* 0x000000000000794d */
"""


def test_counts_read_predicated_instructions_too():
    assert sass_counts(LISTING) == {"instructions": 5, "global_loads": 2}


def test_one_variant_compiles_for_sm_90_and_is_counted(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "sass.json"
    subprocess.run([sys.executable, "-m", "client.tools.benchmarks.sass_stats", "--limit", "1", "--json", str(out)],
                   cwd=ROOT, env=env, check=True, capture_output=True, timeout=300)
    (row,) = json.loads(out.read_text())
    assert row["target"] == "sm_90" and row["qtype"] == "Q4_0" and row["block_m"] == 16
    assert row["instructions"] > 100 and 0 < row["global_loads"] < row["instructions"]


def test_importing_it_leaves_the_interpreter_setting_alone(monkeypatch):
    """(The first version popped TRITON_INTERPRET at import, as kernels.aot does in its own process:
    imported by a test, it took the interpreter from every kernel test after it in that worker.)"""
    import importlib

    import client.tools.benchmarks.sass_stats as sass_stats
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    importlib.reload(sass_stats)
    import os
    assert os.environ.get("TRITON_INTERPRET") == "1"
