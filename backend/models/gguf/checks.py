"""What a GGUF file must satisfy before the importer trusts any of it (docs/quantization.md, Limits).

A GGUF file is a header, key-value metadata, tensor descriptions (name, dimensions, type, offset)
and the tensor data. The ``gguf`` package's reader believes all of it: a count of 2^60 tensors makes
it loop, dimensions whose product overflows uint64 wrap to a small size, and an offset past the end
gives numpy errors that name nothing. So `scan` walks the header once on its own, with every count,
length and offset bounded by the bytes the file really has, and refuses the file with one line
naming what is wrong. Only then does the importer hand the file to ``gguf.GGUFReader``.

`check_config` then checks every value the metadata gives as a config.json's are checked
(backend/models/checkpoint_config.py: positive head counts that divide what they must, finite
numbers in range, a context length within `MAX_CONTEXT_LENGTH`: a file that claims 2^31 positions
would otherwise size a 17 GB rope table at load), naming the GGUF keys, and `check_shapes` holds
the metadata and the tensors to each other: every layer's tensors present with the shapes the
configuration implies.
"""
from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from backend.models.checkpoint_config import MAX_CONTEXT_LENGTH, model_fields
from backend.models.gguf.mapping import GGUFImportError, moe_layer_shapes
from backend.models.gguf.packed import BLOCK_SIZES, tensor_bytes, type_name

__all__ = ["MAX_CONTEXT_LENGTH", "check_config", "check_shapes", "scan"]  # the context cap: checkpoint_config's
MAX_DIMS = 4  # ggml's GGML_MAX_DIMS
MAX_KEY_BYTES = 1 << 16
GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
# value type -> struct format of one scalar (8: string, 9: array are handled apart)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
            11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dims: tuple[int, ...]  # GGUF order, innermost first
    ggml_type: int
    offset: int  # from the start of the data section


class _Cursor:
    """Reads the header forward; every read is bounded by the file's size."""

    def __init__(self, data: bytes, size: int, name: str):
        self.data, self.size, self.pos, self.name = data, size, 0, name

    def take(self, n: int, what: str) -> bytes:
        if n < 0 or self.pos + n > self.size:
            raise GGUFImportError(f"{self.name} is truncated: {what} needs {n} bytes at offset "
                                  f"{self.pos}, the file has {self.size}")
        chunk = self.data[self.pos:self.pos + n]
        self.pos += n
        return chunk

    def scalar(self, fmt: str, what: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), what))[0]

    def string(self, what: str, limit: int | None = None) -> bytes:
        length = self.scalar("<Q", f"the length of {what}")
        if limit is not None and length > limit:
            raise GGUFImportError(f"{self.name}: {what} is {length} bytes long (at most {limit})")
        return self.take(length, what)

    def skip_value(self, vtype: int, what: str) -> Any:
        """Read one metadata value; returns scalars and strings (arrays are skipped, None)."""
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype], what)
        if vtype == _STRING:
            return self.string(what)
        if vtype != _ARRAY:
            raise GGUFImportError(f"{self.name}: {what} has unknown value type {vtype}")
        item_type = self.scalar("<I", f"the item type of {what}")
        count = self.scalar("<Q", f"the length of {what}")
        if item_type in _SCALARS:
            self.take(count * struct.calcsize(_SCALARS[item_type]), f"{what} ({count} items)")
        elif item_type == _STRING:
            if count * 8 > self.size - self.pos:  # every string has at least its 8-byte length
                raise GGUFImportError(f"{self.name} is truncated: {what} claims {count} strings, "
                                      f"more than the {self.size - self.pos} bytes left could hold")
            for i in range(count):
                self.string(f"item {i} of {what}")
        else:
            raise GGUFImportError(f"{self.name}: {what} is an array of unsupported type {item_type}")
        return None


def scan(path: Path) -> list[TensorInfo]:
    """The file's tensor descriptions, after checking that the header, the metadata and every
    tensor's data lie within the file and describe sizes that exist."""
    path = Path(path)
    size = os.path.getsize(path)
    if size < 24:
        raise GGUFImportError(f"{path.name} is not a GGUF file ({size} bytes, less than a header)")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        return _scan(_Cursor(data, size, path.name))


def _scan(cur: _Cursor) -> list[TensorInfo]:
    path, size = Path(cur.name), cur.size
    if cur.take(4, "the magic number") != GGUF_MAGIC:
        raise GGUFImportError(f"{path.name} is not a GGUF file (it does not start with 'GGUF')")
    version = cur.scalar("<I", "the version")
    if version not in (2, 3):
        raise GGUFImportError(f"{path.name}: GGUF version {version} is not supported (2 or 3)")
    tensor_count = cur.scalar("<Q", "the tensor count")
    kv_count = cur.scalar("<Q", "the metadata count")
    left = size - cur.pos
    # a metadata entry takes at least 8 (key length) + 4 (type) + 1 bytes, a tensor description
    # 8 (name length) + 4 (dims) + 8 (one dim) + 4 (type) + 8 (offset)
    if kv_count * 13 > left:
        raise GGUFImportError(f"{path.name}: the metadata count {kv_count} is impossible in a file of "
                              f"{size} bytes")
    if tensor_count * 32 > left:
        raise GGUFImportError(f"{path.name}: the tensor count {tensor_count} is impossible in a file "
                              f"of {size} bytes")
    alignment = DEFAULT_ALIGNMENT
    for _ in range(kv_count):
        key = cur.string("a metadata key", MAX_KEY_BYTES).decode("utf-8", "replace")
        value = cur.skip_value(cur.scalar("<I", f"the type of {key}"), key)
        if key == "general.alignment":
            if not isinstance(value, int) or value <= 0 or value & (value - 1):
                raise GGUFImportError(f"{path.name}: general.alignment {value!r} is not a power of two")
            alignment = value
    tensors = []
    for _ in range(tensor_count):
        name = cur.string("a tensor name", MAX_KEY_BYTES).decode("utf-8", "replace")
        n_dims = cur.scalar("<I", f"the dimension count of {name}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise GGUFImportError(f"tensor {name}: {n_dims} dimensions (1 to {MAX_DIMS})")
        dims = tuple(cur.scalar("<Q", f"the dimensions of {name}") for _ in range(n_dims))
        ggml_type = cur.scalar("<I", f"the type of {name}")
        offset = cur.scalar("<Q", f"the data offset of {name}")
        tensors.append(TensorInfo(name, dims, ggml_type, offset))
    data_start = -(-cur.pos // alignment) * alignment
    seen = set()
    for t in tensors:
        if t.name in seen:
            raise GGUFImportError(f"tensor {t.name} appears twice")
        seen.add(t.name)
        if 0 in t.dims:
            raise GGUFImportError(f"tensor {t.name} has a zero-size dimension: {list(t.dims)}")
        if t.ggml_type not in BLOCK_SIZES:
            continue  # refused by name later, with the list of supported types
        per_block = BLOCK_SIZES[t.ggml_type][0]
        if t.dims[0] % per_block:
            raise GGUFImportError(f"tensor {t.name}: rows of {t.dims[0]} values are not whole "
                                  f"{type_name(t.ggml_type)} blocks of {per_block}")
        end = data_start + t.offset + tensor_bytes(t.ggml_type, tuple(reversed(t.dims)))
        if end > size:
            raise GGUFImportError(f"tensor {t.name} ({type_name(t.ggml_type)} {list(t.dims)}) ends at "
                                  f"byte {end}, past the end of the file ({size} bytes): the file is "
                                  "truncated or the tensor's offset or dimensions are wrong")
    return tensors


def gguf_names(arch: str) -> dict[str, str]:
    """config.json's keys -> the GGUF metadata keys they come from, for checkpoint_config's messages."""
    a = arch
    names = {"hidden_size": "embedding_length", "num_attention_heads": "attention.head_count",
             "num_key_value_heads": "attention.head_count_kv", "intermediate_size": "feed_forward_length",
             "num_hidden_layers": "block_count", "head_dim": "attention.key_length",
             "rms_norm_eps": "attention.layer_norm_rms_epsilon", "rope_theta": "rope.freq_base",
             "max_position_embeddings": "context_length", "rope_scaling.factor": "rope.scaling.factor",
             "rope_parameters.full_attention.rope_theta": "rope.freq_base",
             "rope_parameters.full_attention.factor": "rope.scaling.factor",
             "rope_parameters.sliding_attention.rope_theta": "rope.freq_base_swa",
             "sliding_window": "attention.sliding_window", "final_logit_softcapping": "final_logit_softcapping",
             "num_local_experts": "expert_count", "num_experts": "expert_count",
             "num_experts_per_tok": "expert_used_count", "moe_intermediate_size": "expert_feed_forward_length"}
    return {**{k: f"{a}.{v}" for k, v in names.items()}, "vocab_size": "the vocabulary size",
            "eos_token_id": "tokenizer.ggml.eos_token_id", "bos_token_id": "tokenizer.ggml.bos_token_id"}


def check_config(config: Mapping[str, Any], arch: str, head_dim_given: bool) -> None:
    """The configuration derived from the metadata is one a model can have: every value checked as a
    config.json's is (backend/models/checkpoint_config.py), the GGUF keys named."""
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    if not head_dim_given and isinstance(hidden, int) and isinstance(heads, int) and heads > 0 and hidden % heads:
        raise GGUFImportError(f"{arch}.embedding_length {hidden} is not a multiple of "
                              f"{arch}.attention.head_count {heads}")
    names = gguf_names(arch)
    if not head_dim_given:  # the head size came from the rope's dimensions, or the hidden size per head
        names["head_dim"] = f"{arch}.rope.dimension_count (or embedding_length / attention.head_count)"
    model_fields(config, config["architectures"][0], where="", names=names)


def expected_shapes(config: Mapping[str, Any], arch: str = "llama") -> dict[str, tuple[int, ...]]:
    """Every tensor a model of this configuration has, by GGUF name, with its numpy shape."""
    hidden, vocab, ffn = config["hidden_size"], config["vocab_size"], config["intermediate_size"]
    head_dim = config["head_dim"]
    q = config["num_attention_heads"] * head_dim
    kv = config["num_key_value_heads"] * head_dim
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,)}
    if not config["tie_word_embeddings"]:
        shapes["output.weight"] = (vocab, hidden)
    for i in range(config["num_hidden_layers"]):
        b = f"blk.{i}."
        shapes.update({b + "attn_norm.weight": (hidden,), b + "ffn_norm.weight": (hidden,),
                       b + "attn_q.weight": (q, hidden), b + "attn_k.weight": (kv, hidden),
                       b + "attn_v.weight": (kv, hidden), b + "attn_output.weight": (hidden, q)})
        experts = moe_layer_shapes(config, i)
        shapes.update(experts or {b + "ffn_gate.weight": (ffn, hidden), b + "ffn_up.weight": (ffn, hidden),
                                  b + "ffn_down.weight": (hidden, ffn)})
        if arch in ("qwen3", "gemma3", "qwen3moe"):  # one norm weight per head dimension, shared by the heads
            shapes.update({b + "attn_q_norm.weight": (head_dim,), b + "attn_k_norm.weight": (head_dim,)})
        if arch == "gemma3":  # the attention's and the MLP's output norms
            shapes.update({b + "post_attention_norm.weight": (hidden,), b + "post_ffw_norm.weight": (hidden,)})
    return shapes


_OPTIONAL_BIASES = {"attn_q.bias": "q", "attn_k.bias": "kv", "attn_v.bias": "kv", "attn_output.bias": "hidden"}


def check_shapes(shapes: Mapping[str, tuple[int, ...]], config: Mapping[str, Any], arch: str) -> None:
    """Each tensor (GGUF name -> numpy shape) is one the configuration implies, with that shape,
    and none is missing (the layer count included)."""
    layers = {int(n.split(".")[1]) for n in shapes if n.startswith("blk.") and n.split(".")[1].isdigit()}
    if config["num_hidden_layers"] > len(layers):  # before listing what so many layers would hold
        raise GGUFImportError(f"{arch}.block_count is {config['num_hidden_layers']} but the file has "
                              f"tensors for {len(layers)} layer(s)")
    expected = expected_shapes(config, arch)
    sizes = {"q": config["num_attention_heads"] * config["head_dim"],
             "kv": config["num_key_value_heads"] * config["head_dim"], "hidden": config["hidden_size"]}
    for name, shape in shapes.items():
        want = expected.get(name)
        if want is None and name.startswith("blk.") and name.split(".", 2)[2] in _OPTIONAL_BIASES:
            layer = int(name.split(".")[1])
            want = (sizes[_OPTIONAL_BIASES[name.split(".", 2)[2]]],) if layer < config["num_hidden_layers"] else None
        if want is None:
            if name.startswith("blk."):
                raise GGUFImportError(f"tensor {name} is beyond {arch}.block_count "
                                      f"{config['num_hidden_layers']} or not part of the architecture")
            continue  # other names are refused by the name mapping
        if tuple(shape) != want:
            raise GGUFImportError(f"tensor {name} has shape {list(shape)}; the metadata implies {list(want)}")
    missing = [n for n in expected if n not in shapes]
    if missing:
        raise GGUFImportError(f"{len(missing)} tensor(s) the metadata implies are missing, e.g. "
                              f"{', '.join(missing[:3])} ({arch}.block_count is {config['num_hidden_layers']})")
