"""Fused projections: q/k/v load into one qkv_proj and gate/up into one gate_up_proj, each HF tensor
into its own slice at the explicit shard boundaries (packed_modules_mapping, shard_sizes), biases
too (Qwen2); a missing shard or a wrong-shaped one is refused by name."""
import pytest
import torch
from safetensors import safe_open

from backend.models.loader import iter_weights, load_model_config
from backend.models.llama import LlamaForCausalLM
from hf_checkpoints import make_checkpoint


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory):
    return make_checkpoint("qwen2", tmp_path_factory.mktemp("qwen2"), seed=5)


def _hf_tensors(model_dir):
    with safe_open(str(next(model_dir.glob("*.safetensors"))), framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}


def _load(model_dir, weights=None):
    model = LlamaForCausalLM(load_model_config(model_dir))
    model.load_weights(weights if weights is not None else iter_weights(model_dir))
    return model


# The order the model's forward splits them in (Attention.split: q, k, v; silu_mul: gate, up).
SHARDS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def test_each_hf_tensor_lands_in_its_shard(qwen2_dir):
    model, hf = _load(qwen2_dir), _hf_tensors(qwen2_dir)
    for i, layer in enumerate(model.layers):
        prefix = f"model.layers.{i}"
        for fused, module in (("qkv_proj", layer.self_attn), ("gate_up_proj", layer.mlp)):
            param = getattr(module, fused)
            sub = "self_attn" if fused == "qkv_proj" else "mlp"
            kinds = ("weight", "bias") if fused == "qkv_proj" else ("weight",)  # Qwen2: q/k/v biases
            for kind in kinds:
                parts = [hf[f"{prefix}.{sub}.{name}.{kind}"] for name in SHARDS[fused]]
                assert tuple(p.shape[0] for p in parts) == model.shard_sizes(fused)
                assert torch.equal(getattr(param, kind).data, torch.cat(parts))


def test_a_missing_shard_is_named(qwen2_dir):
    weights = [(n, t) for n, t in _hf_tensors(qwen2_dir).items() if n != "model.layers.1.self_attn.v_proj.weight"]
    with pytest.raises(ValueError, match=r"missing weights: \['layers\.1\.self_attn\.qkv_proj\.weight'\]"):
        _load(qwen2_dir, weights)


def test_a_wrong_shard_shape_is_named(qwen2_dir):
    weights = dict(_hf_tensors(qwen2_dir))
    weights["model.layers.0.mlp.up_proj.weight"] = weights["model.layers.0.mlp.up_proj.weight"][:-1]
    with pytest.raises(ValueError, match=r"'layers\.0\.mlp\.gate_up_proj\.weight' shard 1 has shape"):
        _load(qwen2_dir, list(weights.items()))
