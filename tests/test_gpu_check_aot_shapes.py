"""gpu-check's compile part covers its images and pooling cases (issue 44): every Triton variant the
greedy part's Gemma 3 vision case (client/tools/gpu_check/vision.py) and its pooling case (pooling.py)
launch, whole and chunked, in float32, is among kernels.aot's launches for the shapes the compile part
is given for them (client/tools/gpu_check/compile.py check_shapes, FULL's compile_models). Recorded
as tests/test_warmup_variants.py records them: a fake GPU, nothing launched."""
import json
import os
import subprocess
import sys

import pytest

from test_warmup_variants import ROOT

pytestmark = pytest.mark.slow   # two engines per case in a subprocess

SCRIPT = r"""
import json, os, sys
from pathlib import Path
sys.path.insert(0, "tests")
import torch
from kernels import aot           # the real kernels: TRITON_INTERPRET is unset at import
from kernels.gpu import launch
os.environ["TRITON_INTERPRET"] = "1"     # only so the wrappers accept CPU tensors; nothing is launched
import pytest
from fake_cuda import FakeCuda
FakeCuda().install(pytest.MonkeyPatch())
from backend import LLM, SamplingParams
from client.tools.gpu_check import pooling, vision
from client.tools.gpu_check.compile import check_shapes

def key(l):
    sig, constexprs, attrs, options = aot.specialize(l, 90)
    return repr((l.name, sorted(sig.items()), sorted(constexprs.items()), sorted(attrs.items()),
                 sorted(options.items())))

work = Path(sys.argv[1])
params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
images = [{"prompt_token_ids": p, "multi_modal_data": {"image": [vision._image(*i) for i in imgs]}} if imgs else p
          for p, imgs in vision.CASES]
cases = {"gpu-check-vision": (vision._checkpoint(work / "vision"), {}, lambda llm: llm.generate(images, params)),
         "gpu-check-pooling": (pooling._checkpoint(work / "pooling"), {"runner": "pooling"},
                               lambda llm: (llm.embed(list(pooling.PROMPTS)), llm.generate([pooling.GENERATE], params)))}
result = {}
for name, (path, extra, serve) in cases.items():
    launched = set()
    for budget in (512, 16):
        with launch.recording() as rec:
            llm = LLM(str(path), device="cuda:0", dtype="float32", kv_block_size=16, max_model_len=512,
                      max_num_batched_tokens=budget, enforce_eager=True, **extra)
            serve(llm)
        llm.close()
        launched |= {key(l) for l in rec}
    aot_keys = {key(l) for _, ls in aot.dtype_variants(check_shapes()[name], "fp32", 16) for l in ls}
    result[name] = dict(launched=sorted(launched), missing=sorted(launched - aot_keys))
print(json.dumps(result))
"""


def test_the_compile_part_compiles_what_the_images_and_pooling_cases_launch(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, case in result.items():
        kernels = {eval(k)[0] for k in case["launched"]}  # noqa: S307 (our own repr)
        assert {"prefill_attention_kernel", "decode_attention_kernel", "store_kv_kernel"} <= kernels, (name, kernels)
        assert not case["missing"], (name, case["missing"])
    from client.tools.gpu_check.plan import FULL
    assert {"gpu-check-vision", "gpu-check-pooling"} <= set(FULL["compile_models"])
