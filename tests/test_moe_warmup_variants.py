"""tests/test_warmup_variants.py's check on a Mixtral: every fused-MoE variant serving launches
(decode batches of every size, eager and through the graphs' buffers, prompts short and long) is
compiled by the warm-up, and kernels.aot compiles the same for the model's shape. Of the script's
configurations, only the two it checks run (eager, graphs; int8 weights and LoRA are
tests/test_warmup_variants.py's)."""
import json
import os
import subprocess
import sys

import pytest

from test_warmup_variants import ROOT, SCRIPT

MOE_SCRIPT = (SCRIPT
              .replace("model = make_model(sys.argv[1], seed=0, **SHAPE)",
                       "from pathlib import Path\nfrom hf_checkpoints import make_checkpoint\n"
                       "model = make_checkpoint('mixtral', Path(sys.argv[1]), seed=0)")
              .replace('''shape = aot.ModelShape(SHAPE["hidden_size"], SHAPE["num_attention_heads"], SHAPE["num_key_value_heads"],
                       SHAPE["head_dim"], SHAPE["intermediate_size"])''',
                       "shape = aot.ModelShape(64, 4, 2, 16, 96, experts=8, top_k=2, expert_intermediate=96)")
              .replace("max_num_batched_tokens=48", "max_num_batched_tokens=160"))


@pytest.mark.slow
def test_serving_launches_only_the_fused_moe_variants_the_warm_up_compiled(tmp_path):
    assert MOE_SCRIPT.count("make_checkpoint") == 2 and "experts=8" in MOE_SCRIPT and "=160" in MOE_SCRIPT
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", MOE_SCRIPT, str(tmp_path / "model"), "eager,graphs"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    variants = json.loads(proc.stdout.strip().splitlines()[-1])
    aot = set(variants["aot"])
    for mode in ("eager", "graphs"):
        warm, serving = set(variants[mode]["warm"]), set(variants[mode]["serving"])
        moe = {k for k in serving if "fused_moe_kernel" in k}
        assert moe and serving <= warm, sorted(serving - warm)
        assert moe <= aot, sorted(moe - aot)
        # the gate/up and the down launch, each in both tile configurations: decode steps and short
        # prefills give the 8 experts few pairs each (16-row tiles), a 160-token chunk 40 each on
        # average (64-row tiles, past 32); serving's 300-token prompts take both too
        assert len({k for k in warm if "fused_moe_kernel" in k}) == len(moe) == 4
