"""Every compiled kernel variant that serving launches is compiled by the warm-up, and
`python -m kernels.aot` checks the same variants: no first use compiles in the middle of serving.

Without a GPU, in a process where the kernels are real `@triton.jit` functions: torch.cuda is
patched as a GPU (tests/fake_cuda.py), the launches are recorded instead of run
(kernels.gpu.launch.recording), and each is keyed the way Triton keys its compiled binaries
(kernels.aot.specialize: argument types, integer and alignment specializations, constexprs,
options). The engine's warm-up, then a serving session (prompts of many lengths, chunked
prefills, decode batches of every size, eager and through the graphs' buffers) are compared with
each other and with kernels.aot's launches for the model's shape. Also with the configurations whose
variants the float engine never reaches: int8 weights with enforce_eager and max_num_seqs > 64
(decode batches of 17-64 rows take the quantized GEMMs' 64-row tile, which neither 1 nor
max_num_seqs rows do), and LoRA (the SGMV shrink and expand kernels, serving requests of an adapter
beside base-model ones)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow   # an engine per configuration in a subprocess: ~40-80 s

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = r"""
import json, os, random, sys
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
from backend.models.make_model import make_model
from lora_adapters import make_adapter
from backend.models import quant_linear
from kernels.gpu.quant_dispatch import quant_linear as gpu_quant_linear
# the fake GPU's tensors stay on the CPU: packed weights go to the GPU GEMMs, as on CUDA tensors
# (no C kernel for them, x.is_cuda true)
quant_linear.cpu_kernel = lambda qtype, parts: None
quant_linear.packed_matmul = lambda x, qtype, parts, bias=None: gpu_quant_linear(x, qtype, parts, bias)

SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16)
model = make_model(sys.argv[1], seed=0, **SHAPE)

def key(l):
    sig, constexprs, attrs, options = aot.specialize(l, 90)
    return repr((l.name, sorted(sig.items()), sorted(constexprs.items()), sorted(attrs.items()),
                 sorted(options.items())))

adapter = make_adapter(model, Path(sys.argv[1]).parent / "adapter", seed=1)
COMMON = dict(device="cuda:0", max_model_len=512, max_tokens_in_paged_kv_cache=8192, kv_block_size=16)
CONFIGS = {
    "eager": dict(enforce_eager=True, max_num_seqs=8, max_num_batched_tokens=48),
    "graphs": dict(enforce_eager=False, max_num_seqs=8, max_num_batched_tokens=48),
    "int8-eager": dict(enforce_eager=True, max_num_seqs=80, max_num_batched_tokens=128, quantization="int8"),
    "lora": dict(enforce_eager=False, max_num_seqs=8, max_num_batched_tokens=48, enable_lora=True,
                 max_lora_rank=8, lora_modules=json.dumps({"a": str(adapter)})),
}
BATCHES = {"int8-eager": (1, 30, 70, 5, 45)}   # decode batches of 1, 17-64 and > 64 rows
MODES = sys.argv[2].split(",") if len(sys.argv) > 2 else list(CONFIGS)   # (default: every configuration)

result = {}
for mode in MODES:
    config = CONFIGS[mode]
    with launch.recording() as warm:
        llm = LLM(str(model), **COMMON, **config)
    assert str(llm.engine.runner.dtype) == "torch.bfloat16"
    rng = random.Random(1)
    with launch.recording() as serving:
        for batch in BATCHES.get(mode, (1, 3, 8, 5)):
            prompts = [[rng.randrange(3, 400) for _ in range(rng.choice([1, 2, 15, 16, 17, 40, 100, 300]))]
                       for _ in range(batch)]
            lora = ["a" if i % 2 else None for i in range(batch)] if mode == "lora" else None
            llm.generate(prompts, SamplingParams(max_tokens=rng.randint(2, 20), ignore_eos=True, temperature=0.0),
                         lora_request=lora)
    result[mode] = dict(warm=sorted({key(l) for l in warm}), serving=sorted({key(l) for l in serving}),
                        w8_tiles={when: sorted({(l.constexprs["BLOCK_M"], l.constexprs["BLOCK_N"]) for l in ls
                                                if l.name == "w8_gemm_kernel"})
                                  for when, ls in (("warm", warm), ("serving", serving))})
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


FLOAT_KERNELS = {"decode_attention_kernel", "decode_merge_kernel", "prefill_attention_kernel", "store_kv_kernel",
                 "rms_norm_kernel", "rotary_kernel", "gated_act_kernel"}
KERNELS = {"eager": FLOAT_KERNELS, "graphs": FLOAT_KERNELS,
           "int8-eager": FLOAT_KERNELS | {"w8_gemm_kernel"},   # K too small at this size to split
           "lora": FLOAT_KERNELS | {"lora_shrink_kernel", "lora_expand_kernel"}}


def _kernels(keys) -> set:
    return {eval(k)[0] for k in keys}   # noqa: S307 (our own repr)


@pytest.mark.parametrize("mode", ["eager", "graphs", "int8-eager", "lora"])
def test_serving_launches_only_what_the_warm_up_compiled(variants, mode):
    warm, serving = set(variants[mode]["warm"]), set(variants[mode]["serving"])
    assert serving and serving <= warm, sorted(serving - warm)
    assert _kernels(warm) == KERNELS[mode] and _kernels(serving) == KERNELS[mode]


def test_the_64_row_quantized_tile_is_served_and_warmed(variants):
    """enforce_eager, max_num_seqs 80: decode batches of 1-16, 17-64 and > 64 rows take the w8
    GEMM's 16-row tile, its 64-row decode tile and its prefill tile (64 rows, other N and K tiles)."""
    tiles = variants["int8-eager"]["w8_tiles"]                  # (BLOCK_M, BLOCK_N)
    assert tiles["serving"] == tiles["warm"] == [[16, 64], [64, 64], [64, 128]]


def test_kernels_aot_checks_the_variants_the_warm_up_compiles(variants):
    assert set(variants["eager"]["warm"]) <= set(variants["aot"]), sorted(set(variants["eager"]["warm"]) - set(variants["aot"]))
    assert set(variants["graphs"]["warm"]) <= set(variants["aot"])
    # LoRA's SGMV kernels too (this model's projections are too narrow for kernels.aot's quantized
    # GEMM shapes, whose K is a multiple of 256: those are checked by tests/kernels/test_quant_aot.py)
    assert set(variants["lora"]["warm"]) <= set(variants["aot"]), sorted(set(variants["lora"]["warm"]) - set(variants["aot"]))
