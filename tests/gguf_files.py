"""Small random GGUF files for the tests, written with the gguf package's own writer the way
llama.cpp's converter writes them: q/k rows permuted for Llama, tensors quantized with
``gguf.quants``, the tokenizer stored as ``tokenizer.ggml.*`` metadata.

The tokenizer is the embedded default model's byte-level BPE (backend/models/make_model.py), so the files
carry a real vocabulary and merges without any download.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

SHAPE = dict(hidden=64, ffn=128, layers=2, heads=4, kv_heads=2, head_dim=16)
# The K-quants need rows of whole 256-value super-blocks.
K_SHAPE = dict(hidden=256, ffn=512, layers=2, heads=4, kv_heads=2, head_dim=64)
# Every type the importer reads; tensors take them in turn so each appears more than once.
ALL_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")
K_TYPES = ("Q4_K", "Q5_K", "Q6_K")
CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
                 "{% if add_generation_prompt %}<s>assistant\n{% endif %}")


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf does to q_proj/k_proj rows of Llama models."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_weights(vocab: int, seed: int, qkv_bias: bool, tied: bool, s: dict = SHAPE) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    q, kv = s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]
    w = {"model.embed_tokens.weight": rng.standard_normal((vocab, s["hidden"])),
         "model.norm.weight": 1 + 0.1 * rng.standard_normal(s["hidden"])}
    if not tied:
        w["lm_head.weight"] = rng.standard_normal((vocab, s["hidden"]))
    for i in range(s["layers"]):
        p = f"model.layers.{i}."
        shapes = {"self_attn.q_proj": (q, s["hidden"]), "self_attn.k_proj": (kv, s["hidden"]),
                  "self_attn.v_proj": (kv, s["hidden"]), "self_attn.o_proj": (s["hidden"], q),
                  "mlp.gate_proj": (s["ffn"], s["hidden"]), "mlp.up_proj": (s["ffn"], s["hidden"]),
                  "mlp.down_proj": (s["hidden"], s["ffn"])}
        for name, shape in shapes.items():
            w[p + name + ".weight"] = rng.standard_normal(shape) / np.sqrt(shape[1])
        if qkv_bias:
            for name in ("q_proj", "k_proj", "v_proj"):
                w[p + f"self_attn.{name}.bias"] = 0.1 * rng.standard_normal(w[p + f"self_attn.{name}.weight"].shape[0])
        w[p + "input_layernorm.weight"] = 1 + 0.1 * rng.standard_normal(s["hidden"])
        w[p + "post_attention_layernorm.weight"] = 1 + 0.1 * rng.standard_normal(s["hidden"])
    return {k: v.astype(np.float32) for k, v in w.items()}


_GGUF_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output",
               "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
               "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down"}


def gguf_name(hf: str) -> str:
    base, suffix = hf.rsplit(".", 1)
    if base.startswith("model.layers."):
        _, _, layer, part = base.split(".", 3)
        return f"blk.{layer}.{_GGUF_NAMES[part]}.{suffix}"
    return f"{_GGUF_NAMES[base]}.{suffix}"


def tokenizer_metadata(tokenizer_json: Path) -> tuple[list[str], list[str], list[int]]:
    """tokens, merges and token types of a byte-level tokenizer.json (added tokens are control)."""
    data = json.loads(Path(tokenizer_json).read_text())
    vocab = data["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    added = {t["id"] for t in data["added_tokens"]}
    return tokens, merges, [3 if i in added else 1 for i in range(len(tokens))]


def write_gguf(path: Path, tokenizer_json: Path, arch: str = "llama", seed: int = 0,
               types: Sequence[str] = ALL_TYPES, name: Optional[str] = None, tied: bool = True,
               pre: str = "smollm", tensor_type_override: Optional[tuple[str, int]] = None,
               extra_tensors: Optional[dict] = None, shape: Optional[dict] = None,
               metadata: Optional[dict] = None, skip_tensors: Sequence[str] = (),
               raw_metadata: Optional[dict] = None) -> dict:
    """Write a random ``arch`` model; return its HF-named float32 weights (before quantization).

    ``tensor_type_override`` = (gguf tensor name, raw ggml type id) writes that tensor's bytes
    labelled with a type the importer may not read (zeros of the right size). ``shape`` replaces
    SHAPE (K_SHAPE for the K-quants); ``metadata`` replaces the values of the architecture keys it
    names (``{"head_count": 0}``: hostile files); ``skip_tensors`` leaves GGUF tensors out;
    ``raw_metadata`` sets (or replaces) whole keys with values of any type (``{"llama.rope.freq_base":
    "x"}``), a list as an array of its first item's type."""
    import gguf
    from gguf import GGMLQuantizationType as T

    s = shape or SHAPE
    tokens, merges, token_types = tokenizer_metadata(tokenizer_json)
    weights = hf_weights(len(tokens), seed, qkv_bias=(arch == "qwen2"), tied=tied, s=s)
    keys = {"block_count": s["layers"], "context_length": 256, "embedding_length": s["hidden"],
            "feed_forward_length": s["ffn"], "head_count": s["heads"], "head_count_kv": s["kv_heads"],
            **(metadata or {})}
    writer = gguf.GGUFWriter(str(path), arch)
    if name:
        writer.add_name(name)
    add_shape(writer, keys["block_count"], keys["context_length"], keys["embedding_length"],
              keys["feed_forward_length"], keys["head_count"], keys["head_count_kv"], 1e-5)
    writer.add_rope_freq_base(10000.0)
    if arch != "qwen2":
        writer.add_rope_dimension_count(s["head_dim"])
    add_bpe_tokenizer(writer, tokens, merges, token_types, pre)
    writer.add_chat_template(CHAT_TEMPLATE)
    for key, value in (raw_metadata or {}).items():
        if isinstance(value, list):
            writer.add_array(key, value)
        elif isinstance(value, int) and not isinstance(value, bool) and not -2**31 <= value < 2**31:
            writer.add_key_value(key, value, gguf.GGUFValueType.INT64)
        else:
            writer.add_key_value(key, value, gguf.GGUFValueType.get_type(value))
    matrices = 0
    for hf, w in weights.items():
        data = w
        if arch != "qwen2" and ".q_proj." in hf:
            data = llama_cpp_permute(w, s["heads"])
        elif arch != "qwen2" and ".k_proj." in hf:
            data = llama_cpp_permute(w, s["kv_heads"])
        qtype = T.F32
        if data.ndim == 2:
            qtype = T[types[matrices % len(types)]]
            matrices += 1
        name_ = gguf_name(hf)
        if name_ in skip_tensors:
            continue
        if tensor_type_override and tensor_type_override[0] == name_:
            raw_type = T(tensor_type_override[1])
            block, size = gguf.GGML_QUANT_SIZES[raw_type]
            raw = np.zeros((data.shape[0], data.shape[1] // block * size), dtype=np.uint8)
            writer.add_tensor(name_, raw, raw_dtype=raw_type)
        elif qtype == T.F32:
            writer.add_tensor(name_, data)
        else:
            writer.add_tensor(name_, quantize(data, qtype.name), raw_dtype=qtype)
    for name_, data in (extra_tensors or {}).items():
        writer.add_tensor(name_, data)
    finish(writer)
    return weights


def add_shape(writer, layers: int, context: int, hidden: int, ffn: int, heads: int, kv_heads: int,
              eps: float) -> None:
    """The architecture keys every file has."""
    writer.add_block_count(layers)
    writer.add_context_length(context)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(eps)


def add_bpe_tokenizer(writer, tokens: list[str], merges: list[str], token_types: list[int], pre: str) -> None:
    """A byte-level BPE tokenizer as ``tokenizer.ggml.*`` metadata (BOS 1, EOS 2)."""
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)


def finish(writer) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_sentencepiece_gguf(path: Path, tokenizer_json: Path) -> None:
    """A one-layer float32 Llama file whose tokenizer is SentencePiece-style (``tokenizer.ggml.model`` =
    llama, as Llama 2 and Mistral files have): "▁" for spaces, <0xNN> byte tokens, merges implied by
    the scores. The pieces are the ASCII ones of the default model's vocabulary, respelled."""
    import gguf

    tokens, _, _ = tokenizer_metadata(tokenizer_json)
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    pieces = dict.fromkeys(t.replace("Ġ", "▁") for t in tokens[3:]
                           if all(ord(c) < 128 or c == "Ġ" for c in t))
    vocab = ["<unk>", "<s>", "</s>"] + byte_tokens + [p for p in pieces if p not in byte_tokens]
    types = [2, 3, 3] + [6] * 256 + [1] * (len(vocab) - 259)  # unknown, control, byte, normal
    scores = [0.0] * 259 + [-float(i) for i in range(len(vocab) - 259)]
    s = dict(SHAPE, layers=1)
    writer = gguf.GGUFWriter(str(path), "llama")
    add_shape(writer, 1, 64, s["hidden"], s["ffn"], s["heads"], s["kv_heads"], 1e-5)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(vocab)
    writer.add_token_types(types)
    writer.add_token_scores(scores)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    for hf, w in hf_weights(len(vocab), 0, qkv_bias=False, tied=True, s=s).items():
        writer.add_tensor(gguf_name(hf), w)
    finish(writer)


def llama_cpp_rope_factors(head_dim: int, theta: float, factor: float, low_freq_factor: float = 1.0,
                           high_freq_factor: float = 4.0, old_context_len: int = 8192) -> np.ndarray:
    """``rope_freqs`` as llama.cpp's converter computes it for a Llama 3.1+ checkpoint."""
    factors = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < old_context_len / high_freq_factor:
            factors.append(1.0)
        elif wavelen > old_context_len / low_freq_factor:
            factors.append(factor)
        else:
            smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


# -- quantizers: gguf-py writes Q8_0..Q5_1 but not the K-quants --------------------------------------
def quantize(data: np.ndarray, qtype: str) -> np.ndarray:
    """float32 [rows, K] -> ggml blocks [rows, bytes] of ``qtype`` (gguf-py's own quantizer, or a
    plain one of ours for the K-quants: any valid encoding serves, gguf dequantizes it)."""
    import gguf
    if qtype in K_QUANTIZERS:
        return K_QUANTIZERS[qtype](np.asarray(data, np.float32))
    return gguf.quants.quantize(np.asarray(data, np.float32), gguf.GGMLQuantizationType[qtype])


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)[..., None].view(np.uint8)


def _safe_div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.where(b != 0, a / np.where(b != 0, b, 1), 0.0)


def _k_scales_mins(x: np.ndarray, top: int):
    """Per super-block [rows, nb, 8, 32] -> fp16 d and dmin, 6-bit sub-scales and mins, codes."""
    lo = np.minimum(x.min(axis=-1), 0.0)  # as llama.cpp: the min is never positive
    scale = (x.max(axis=-1) - lo) / top
    d = (scale.max(axis=-1) / 63).astype(np.float16).astype(np.float32)
    dmin = ((-lo).max(axis=-1) / 63).astype(np.float16).astype(np.float32)
    sc = np.clip(np.rint(_safe_div(scale, d[..., None])), 0, 63).astype(np.uint8)
    m = np.clip(np.rint(_safe_div(-lo, dmin[..., None])), 0, 63).astype(np.uint8)
    step = (d[..., None] * sc)[..., None]
    q = np.clip(np.rint(_safe_div(x + (dmin[..., None] * m)[..., None], step)), 0, top).astype(np.uint8)
    packed = np.concatenate([(sc[..., :4] & 63) | ((sc[..., 4:] >> 4) << 6),
                             (m[..., :4] & 63) | ((m[..., 4:] >> 4) << 6),
                             (sc[..., 4:] & 15) | ((m[..., 4:] & 15) << 4)], axis=-1)
    return d, dmin, packed, q


def _q4_k_or_q5_k(x: np.ndarray, five: bool) -> np.ndarray:
    rows, k = x.shape
    nb = k // 256
    d, dmin, scales, q = _k_scales_mins(x.reshape(rows, nb, 8, 32), 31 if five else 15)
    q = q.reshape(rows, nb, 4, 2, 32)  # chunk j of 64: values 64j + l and 64j + 32 + l share byte 32j + l
    qs = ((q[:, :, :, 0] & 15) | ((q[:, :, :, 1] & 15) << 4)).reshape(rows, nb, 128)
    parts = [_f16_bytes(d), _f16_bytes(dmin), scales]
    if five:  # qh[l] bit g: bit 4 of value l of group g
        bits = (q.reshape(rows, nb, 8, 32) >> 4) & 1
        parts.append((bits << np.arange(8, dtype=np.uint8)[None, None, :, None]).sum(axis=2, dtype=np.uint8))
    parts.append(qs)
    return np.concatenate(parts, axis=-1).reshape(rows, -1)


def _q6_k(x: np.ndarray) -> np.ndarray:
    rows, k = x.shape
    nb = k // 256
    g = x.reshape(rows, nb, 16, 16)
    scale = np.abs(g).max(axis=-1) / 31
    d = (scale.max(axis=-1) / 127).astype(np.float16).astype(np.float32)
    sc = np.clip(np.rint(_safe_div(scale, d[..., None])), -128, 127).astype(np.int8)
    step = (d[..., None] * sc)[..., None]
    q = (np.clip(np.rint(_safe_div(g, step)), -32, 31) + 32).astype(np.uint8).reshape(rows, nb, 2, 4, 32)
    ql = np.concatenate([(q[:, :, :, 0] & 15) | ((q[:, :, :, 2] & 15) << 4),
                         (q[:, :, :, 1] & 15) | ((q[:, :, :, 3] & 15) << 4)], axis=-1)  # [rows, nb, 2, 64]
    qh = ((q >> 4) << np.array([0, 2, 4, 6], np.uint8)[None, None, None, :, None]).sum(axis=3, dtype=np.uint8)
    return np.concatenate([ql.reshape(rows, nb, 128), qh.reshape(rows, nb, 64),
                           sc.view(np.uint8), _f16_bytes(d)], axis=-1).reshape(rows, -1)


K_QUANTIZERS = {"Q4_K": lambda x: _q4_k_or_q5_k(x, False), "Q5_K": lambda x: _q4_k_or_q5_k(x, True),
                "Q6_K": _q6_k}


# -- hostile files: a good file with its header patched ----------------------------------------------
def patch_bytes(path: Path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def tensor_info_offsets(path: Path, tensor: str) -> dict[str, int]:
    """Byte offsets of a tensor description's fields: n_dims, dims (the first), type, offset."""
    import gguf
    info = next(t for t in gguf.GGUFReader(str(path)).tensors if t.name == tensor).field
    pos = info.offset + 8 + len(tensor.encode())
    n_dims = len(info.parts[3])
    return {"n_dims": pos, "dims": pos + 4, "type": pos + 4 + 8 * n_dims, "offset": pos + 8 + 8 * n_dims}


# -- a transformers checkpoint as llama.cpp's convert_hf_to_gguf.py writes it (Qwen3, Gemma 3) -------
_GGUF_ARCH = {"Qwen3ForCausalLM": "qwen3", "Gemma3ForCausalLM": "gemma3"}
_NORM_NAMES = {"qwen3": {"self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"},
               "gemma3": {"self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
                          "post_attention_layernorm": "post_attention_norm",
                          "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"}}


def write_gguf_from_hf(path: Path, hf_dir: Path, tokenizer_json: Path, types: Sequence[str] = ("F32",)) -> str:
    """Convert a transformers checkpoint of Qwen3 or Gemma 3 into a GGUF file the way llama.cpp's
    converter does: its metadata keys, its tensor names, q/k rows as they are (no permutation for
    these architectures), every Gemma norm weight stored as 1 + w, the global layers' RoPE base and
    linear scaling, no output.weight when tied. Matrices take `types` in turn. Returns the GGUF
    architecture name."""
    import gguf
    from gguf import GGMLQuantizationType as T
    from safetensors.numpy import load_file

    config = json.loads((Path(hf_dir) / "config.json").read_text())
    arch = _GGUF_ARCH[config["architectures"][0]]
    weights = load_file(str(Path(hf_dir) / "model.safetensors"))
    tokens, merges, token_types = tokenizer_metadata(tokenizer_json)
    writer = gguf.GGUFWriter(str(path), arch)
    add_shape(writer, config["num_hidden_layers"], config["max_position_embeddings"], config["hidden_size"],
              config["intermediate_size"], config["num_attention_heads"], config["num_key_value_heads"],
              config["rms_norm_eps"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    rope = config["rope_parameters"]
    rope = rope.get("full_attention", rope)  # Gemma 3: the global layers' (llama.cpp's freq_base)
    writer.add_rope_freq_base(rope["rope_theta"])
    if rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    if arch == "gemma3":
        writer.add_sliding_window(config["sliding_window"])
        if config.get("final_logit_softcapping"):
            writer.add_final_logit_softcapping(config["final_logit_softcapping"])
    add_bpe_tokenizer(writer, tokens, merges, token_types, "smollm")
    names = {**_GGUF_NAMES, **_NORM_NAMES[arch]}
    matrices = 0
    for hf, w in weights.items():
        w = w.astype(np.float32)
        if arch == "gemma3" and hf.endswith("norm.weight"):
            w = w + 1.0
        base, suffix = hf.rsplit(".", 1)
        if base.startswith("model.layers."):
            _, _, layer, part = base.split(".", 3)
            name = f"blk.{layer}.{names[part]}.{suffix}"
        else:
            name = f"{names[base]}.{suffix}"
        qtype = T.F32
        if w.ndim == 2:
            qtype = T[types[matrices % len(types)]]
            matrices += 1
        writer.add_tensor(name, w if qtype == T.F32 else quantize(w, qtype.name),
                          raw_dtype=None if qtype == T.F32 else qtype)
    finish(writer)
    return arch


# -- mixtures of experts: a transformers checkpoint written as llama.cpp's converter writes it ----------
def write_moe_gguf(path: Path, tokenizer_json: Path, hf_dir: Path, types: Sequence[str] = ("F32",)) -> None:
    """The safetensors checkpoint of a tiny Mixtral (GGUF arch ``llama`` with experts) or Qwen3-MoE
    (``qwen3moe``) in ``hf_dir`` as a GGUF file: each layer's experts stacked into ffn_gate_exps /
    ffn_up_exps [E, I, H] and ffn_down_exps [E, H, I], the router as ffn_gate_inp (F32, as llama.cpp
    keeps it), q/k rows permuted for ``llama``; the matrices (stacked experts included) take
    ``types`` in turn. Its vocabulary must be the tokenizer's."""
    import gguf
    from gguf import GGMLQuantizationType as T
    from safetensors.numpy import load_file

    config = json.loads((hf_dir / "config.json").read_text())
    weights = load_file(str(hf_dir / "model.safetensors"))
    mixtral = config["model_type"] == "mixtral"
    arch = "llama" if mixtral else "qwen3moe"
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    experts = config.get("num_local_experts") or config.get("num_experts")
    tokens, merges, token_types = tokenizer_metadata(tokenizer_json)
    assert len(tokens) == config["vocab_size"], "the checkpoint's vocabulary must be the tokenizer's"
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(256)
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base((config.get("rope_parameters") or {}).get("rope_theta", config.get("rope_theta")))
    writer.add_expert_count(experts)
    writer.add_expert_used_count(config["num_experts_per_tok"])
    if mixtral:
        writer.add_rope_dimension_count(head_dim)
    else:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
        writer.add_expert_weights_norm(config["norm_topk_prob"])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    block = "block_sparse_moe" if mixtral else "mlp"
    parts = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    tensors = {"token_embd.weight": weights["model.embed_tokens.weight"], "output_norm.weight": weights["model.norm.weight"]}
    if "lm_head.weight" in weights:
        tensors["output.weight"] = weights["lm_head.weight"]
    for i in range(config["num_hidden_layers"]):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        for hf, name in _GGUF_NAMES.items():
            if p + hf + ".weight" in weights:
                w = weights[p + hf + ".weight"]
                if mixtral and hf in ("self_attn.q_proj", "self_attn.k_proj"):
                    w = llama_cpp_permute(w, heads if hf.endswith("q_proj") else kv_heads)
                tensors[b + name + ".weight"] = w
        for hf, name in (("self_attn.q_norm", "attn_q_norm"), ("self_attn.k_norm", "attn_k_norm")):
            if p + hf + ".weight" in weights:
                tensors[b + name + ".weight"] = weights[p + hf + ".weight"]
        if p + f"{block}.gate.weight" in weights:
            tensors[b + "ffn_gate_inp.weight"] = weights[p + f"{block}.gate.weight"]
            for part, name in zip(parts, ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")):
                tensors[b + name + ".weight"] = np.stack(
                    [weights[p + f"{block}.experts.{e}.{part}.weight"] for e in range(experts)])
    matrices = 0
    for name, data in tensors.items():
        qtype = T.F32
        if data.ndim >= 2 and "ffn_gate_inp" not in name:
            qtype = T[types[matrices % len(types)]]
            matrices += 1
        if qtype == T.F32:
            writer.add_tensor(name, np.ascontiguousarray(data, np.float32))
        else:
            rows = quantize(data.reshape(-1, data.shape[-1]), qtype.name)
            writer.add_tensor(name, rows.reshape(*data.shape[:-1], -1), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
