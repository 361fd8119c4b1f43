"""How a Llama-family model splits over tensor-parallel ranks (Megatron-style), checked once.

Each rank holds:
- column-parallel q/k/v and gate/up: rows [r*n/N, (r+1)*n/N) of each of q, k, v (whole heads: rank r
  computes attention for its own query heads and the KV heads they read) and of gate, up;
- row-parallel o_proj and down_proj: columns [r*K/N, (r+1)*K/N), the inputs its own heads and its
  own slice of the MLP produce; the partial outputs are summed by one all-reduce each
  (backend/models/parallel/layers.py); a bias is added once, by rank 0;
- vocabulary-parallel embedding and LM head: rows [r*S, (r+1)*S) of the vocabulary, S = ceil(V/N),
  the last rank's rows past V zero;
- mixture-of-experts layers (backend/models/moe.py): every expert split as a dense MLP is, rows of
  its gate and up, columns of its down, so each rank holds a slice of every expert's intermediate
  dimension and the block's partial outputs join in the same one all-reduce; the router whole
  (every rank routes the same tokens the same way). Packed experts stacked [E, ...] (a GGUF
  import's) are cut the same way one dimension in;
- everything else (norms) whole.

Packed quantized matrices (docs/quantization.md) split the same way: every array of a matrix has
its N rows, so a row split cuts each array's rows; a column split cuts each array's columns in the
same proportion, which is exact only when K/N is whole groups (32 values; 256 for the K-quants'
super-blocks); `ShardPlan.check` refuses the others, naming the numbers.

No torch here: tensors are sliced through their own methods (`narrow`, `new_zeros`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Mapping, Optional

from backend.models.weight_shapes import SKIPPED as VISION_PREFIXES  # a vision tower's and projector's names

# Values per quantization group along K (docs/quantization.md): the K-quants scale by super-blocks.
GROUP_VALUES = {"Q4_K": 256, "Q5_K": 256, "Q6_K": 256}
DEFAULT_GROUP_VALUES = 32
# (Mixtral's experts name their gate, up and down w1, w3 and w2)
COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "w1", "w3")
ROW_PARALLEL = ("o_proj", "down_proj", "w2")
VOCAB_PARALLEL = ("embed_tokens", "lm_head")


@dataclass(frozen=True)
class ShardPlan:
    rank: int
    size: int
    vocab_size: int  # the full vocabulary

    @property
    def vocab_shard(self) -> int:
        """Vocabulary rows per rank (the last rank's rows past vocab_size are zero)."""
        return -(-self.vocab_size // self.size)

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_shard

    @property
    def vocab_end(self) -> int:
        return min(self.vocab_size, self.vocab_start + self.vocab_shard)

    @classmethod
    def check(cls, cfg: Any, size: int, rank: int = 0, quantized: Optional[Mapping[str, str]] = None,
              int8: bool = False) -> "ShardPlan":
        """The plan of `rank`, or a ValueError naming what does not divide. `cfg` is the model's
        ModelConfig; `quantized` maps HF module names to their packed GGUF type; `int8`: float
        weights quantized at load in groups of 32 (quantization=int8)."""
        if size < 1 or not 0 <= rank < size:
            raise ValueError(f"tensor_parallel_size must be >= 1 with 0 <= rank < it; got {size}, rank {rank}")
        sizes = [("num_attention_heads", cfg.num_heads), ("num_key_value_heads", cfg.num_kv_heads),
                 ("intermediate_size", cfg.intermediate_size)]
        if getattr(cfg, "num_experts", 0):
            sizes.append(("moe_intermediate_size", cfg.moe_intermediate_size))
        for field, value in sizes:
            if value % size:
                raise ValueError(
                    f"tensor_parallel_size {size} does not divide the model's {field} {value}: each rank holds "
                    f"an equal share of whole heads and MLP columns ({', '.join(f'{f} {v}' for f, v in sizes)}); use "
                    f"a tensor_parallel_size that divides all {len(sizes)}")
        inputs = {"o_proj": cfg.num_heads * cfg.head_dim, "down_proj": cfg.intermediate_size}
        expert_inputs = getattr(cfg, "moe_intermediate_size", 0)
        for name, qtype in (quantized or {}).items():
            kind = name.rsplit(".", 1)[-1]
            if ".experts." in name and kind in ("down_proj", "w2"):
                _check_groups(name, qtype, expert_inputs, size)
            elif kind in inputs:
                _check_groups(name, qtype, inputs[kind], size)
        if int8 and size > 1:
            if expert_inputs and getattr(cfg, "num_experts", 0):
                inputs["experts' down_proj"] = expert_inputs
            for kind, k in inputs.items():
                if k % DEFAULT_GROUP_VALUES == 0:  # quantized at load (else kept float, at any size)
                    _check_groups(kind, "Q8_0 (quantization=int8)", k, size, DEFAULT_GROUP_VALUES)
        return cls(rank, size, cfg.vocab_size)

    def local_config(self, cfg: Any) -> Any:
        """The ModelConfig of this rank's shard: its heads, MLP columns and vocabulary rows."""
        return dataclasses.replace(cfg, num_heads=cfg.num_heads // self.size,
                                   num_kv_heads=cfg.num_kv_heads // self.size,
                                   intermediate_size=cfg.intermediate_size // self.size,
                                   moe_intermediate_size=getattr(cfg, "moe_intermediate_size", 0) // self.size,
                                   vocab_size=self.vocab_shard)

    # -- the weights -------------------------------------------------------------------------------
    def shard_weights(self, weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        """(HF name, tensor) -> (HF name, this rank's part of it), for float and packed tensors."""
        for name, tensor in weights:  # (a vision tower's, which the decoder skips, stay whole: its
            # q_proj or fc1 are not the decoder's and need not divide; rank 0 runs it whole)
            yield name, tensor if name.startswith(VISION_PREFIXES) else self.shard(name, tensor)

    def shard(self, name: str, tensor: Any) -> Any:
        module, _, array = name.rpartition(".")
        parent, _, kind = module.rpartition(".")
        stacked = int(parent.endswith(".experts"))   # packed experts [E, ...]: each expert's rows or columns
        if kind in COLUMN_PARALLEL:
            return self._part(tensor, stacked)
        if kind in ROW_PARALLEL:
            if array == "bias":  # the all-reduce sums every rank's output: the bias is added once
                return tensor if self.rank == 0 else tensor.new_zeros(tensor.shape)
            return self._part(tensor, stacked + 1)
        if kind in VOCAB_PARALLEL:
            part = tensor.narrow(0, self.vocab_start, self.vocab_end - self.vocab_start)
            if part.shape[0] < self.vocab_shard:  # the last rank: rows past the vocabulary are zero
                padded = tensor.new_zeros((self.vocab_shard,) + tuple(tensor.shape[1:]))
                padded[: part.shape[0]] = part
                return padded
            return part.contiguous()
        return tensor

    def shard_lora(self, module: str, a: Any, b: Any) -> tuple[Any, Any]:
        """This rank's part of a LoRA pair (A [r, in], B [out, r]) on HF module `module`
        (backend/worker/lora/tensor_parallel.py): a column-parallel module's B keeps the rank's output
        rows (its delta lands on the rank's columns); a row-parallel module's A keeps the rank's
        input columns, and the rank's delta x_r A_r^T B^T is a partial sum that joins the partial
        output before its all-reduce (the ranks' parts sum to x A^T B^T)."""
        if module in COLUMN_PARALLEL:
            return a, self._part(b, 0)
        if module in ROW_PARALLEL:
            return self._part(a, 1), b
        raise ValueError(f"LoRA on {module} is not split by tensor parallelism")

    def _part(self, tensor: Any, dim: int) -> Any:
        length = tensor.shape[dim] // self.size
        if length * self.size != tensor.shape[dim]:
            raise ValueError(f"a weight of shape {tuple(tensor.shape)} does not split in {self.size} along "
                             f"dimension {dim}")
        return tensor.narrow(dim, self.rank * length, length).contiguous()


def _check_groups(name: str, qtype: str, k: int, size: int, group: Optional[int] = None) -> None:
    group = group or GROUP_VALUES.get(qtype, DEFAULT_GROUP_VALUES)
    if (k // size) % group or k % size:
        raise ValueError(
            f"tensor_parallel_size {size} would cut the quantization groups of {name} ({qtype}): its "
            f"{k} inputs split in {size} are {k / size:g} per rank, not a multiple of the {group} values a "
            f"group holds; use a tensor_parallel_size for which {k} / size is a multiple of {group}, or "
            "float weights")

