"""Every compiled kernel variant that serving launches is compiled by the warm-up, and
`python -m kernels.aot` checks the same variants: no first use compiles in the middle of serving.

Without a GPU, in a process where the kernels are real `@triton.jit` functions: torch.cuda is
patched as a GPU (tests/fake_cuda.py), the launches are recorded instead of run
(kernels.launch.recording), and each is keyed the way Triton keys its compiled binaries
(kernels.aot.specialize: argument types, integer and alignment specializations, constexprs,
options). The engine's warm-up, then a serving session (prompts of many lengths, chunked
prefills, decode batches of every size, eager and through the graphs' buffers) are compared with
each other and with kernels.aot's launches for the model's shape."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = r"""
import json, os, random, sys
sys.path.insert(0, "tests")
import torch
from kernels import aot, launch           # the real kernels: TRITON_INTERPRET is unset at import
os.environ["TRITON_INTERPRET"] = "1"     # only so the wrappers accept CPU tensors; nothing is launched
import pytest
from fake_cuda import FakeCuda
FakeCuda().install(pytest.MonkeyPatch())
from backend import LLM, SamplingParams
from backend.make_model import make_model

SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16)
model = make_model(sys.argv[1], seed=0, **SHAPE)

def key(l):
    sig, constexprs, attrs, options = aot.specialize(l, 90)
    return repr((l.name, sorted(sig.items()), sorted(constexprs.items()), sorted(attrs.items()),
                 sorted(options.items())))

result = {}
for eager in (True, False):
    with launch.recording() as warm:
        llm = LLM(str(model), device="cuda:0", enforce_eager=eager, max_num_seqs=8, max_num_batched_tokens=48,
                  max_model_len=512, max_tokens_in_paged_kv_cache=4096, kv_block_size=16)
    assert str(llm.engine.runner.dtype) == "torch.bfloat16"
    rng = random.Random(1)
    with launch.recording() as serving:
        for batch in (1, 3, 8, 5):
            prompts = [[rng.randrange(3, 400) for _ in range(rng.choice([1, 2, 15, 16, 17, 40, 100, 300]))]
                       for _ in range(batch)]
            llm.generate(prompts, SamplingParams(max_tokens=rng.randint(2, 20), ignore_eos=True, temperature=0.0))
    result["eager" if eager else "graphs"] = dict(warm=sorted({key(l) for l in warm}),
                                                  serving=sorted({key(l) for l in serving}))
shape = aot.ModelShape(SHAPE["hidden_size"], SHAPE["num_attention_heads"], SHAPE["num_key_value_heads"],
                       SHAPE["head_dim"], SHAPE["intermediate_size"])
result["aot"] = sorted({key(l) for l in aot.model_launches(shape, torch.bfloat16, 16)})
print(json.dumps(result))
"""


@pytest.fixture(scope="module")
def variants(tmp_path_factory):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path_factory.mktemp("variants") / "model"
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(out)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("mode", ["eager", "graphs"])
def test_serving_launches_only_what_the_warm_up_compiled(variants, mode):
    warm, serving = set(variants[mode]["warm"]), set(variants[mode]["serving"])
    assert serving and serving <= warm, sorted(serving - warm)
    kernels = {json.loads(json.dumps(eval(k)))[0] for k in warm}   # noqa: S307 (our own repr)
    assert kernels == {"decode_attention_kernel", "decode_merge_kernel", "prefill_attention_kernel",
                       "store_kv_kernel", "rms_norm_kernel", "rotary_kernel", "gated_act_kernel"}


def test_kernels_aot_checks_the_variants_the_warm_up_compiles(variants):
    assert set(variants["eager"]["warm"]) <= set(variants["aot"]), sorted(set(variants["eager"]["warm"]) - set(variants["aot"]))
    assert set(variants["graphs"]["warm"]) <= set(variants["aot"])
