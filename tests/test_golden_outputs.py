"""The engine's outputs equal those recorded before the floor-plan move of issue 42, bit for bit on
the CPU they were recorded on (tests/golden_outputs.py says how, and why a subprocess): SmolLM2 Q4_1
and float32, tiny Qwen3 / Gemma 3 / Mixtral, LoRA adapters beside the base model, TP=2, n-gram and
draft speculation, a JSON schema, and seeded sampling with penalties and n = 2."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from golden_outputs import ENV

HERE = Path(__file__).resolve().parent
RECORDED = HERE / "data" / "golden_outputs.json"


@pytest.mark.slow
def test_outputs_equal_the_ones_recorded_before_the_move():
    from smollm2 import smollm2_dir, smollm2_packed_dir
    smollm2_dir(), smollm2_packed_dir()  # fetched here, in the test's tier, not in the subprocess
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | ENV
    done = subprocess.run([sys.executable, str(HERE / "golden_outputs.py"), "--check", str(RECORDED)], env=env,
                          capture_output=True, text=True, timeout=600)
    report = [line for line in done.stdout.splitlines() if line.startswith(("compared", "smollm2", "qwen3", "gemma3",
                                                                                "mixtral", "lora", "tp2", "ngram",
                                                                                "draft", "json", "sampled"))]
    assert done.returncode == 0, "\n".join(report) + done.stderr[-3000:]
    assert any(line.startswith("compared 74 outputs of 11 cases") for line in report), done.stdout
