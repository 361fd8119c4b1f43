"""The GGUF files of issue 47's peer table that no package carries, written with the ``gguf`` package
so that llama.cpp's `llama-server` and `inflight import-gguf` read the same file:

- ``qwen3``: a Qwen3-0.6B-shaped model (28 layers, hidden 1024, 16 query / 8 KV heads of 128, q/k
  RMS norms, FFN 3072, tied embeddings), random weights from a fixed seed, in Q8_0 or Q4_K;
- ``qwen3moe``: a Qwen3-MoE-shaped model (16 layers of 32 experts, top 4, expert FFN 384; names and
  keys of llama.cpp's ``qwen3moe``: stacked ``ffn_{gate,up,down}_exps`` [E, I, H] / [E, H, I], the
  router ``ffn_gate_inp`` [E, H] in F32, ``expert_feed_forward_length``);
- ``float_copy``: a GGUF file re-written with F16 or BF16 matrices (SmolLM2's Q4_1 file dequantized
  by gguf-py: the same values llama.cpp and inflight read from it), metadata copied whole.

The synthetic models take their vocabulary and tokenizer from another GGUF file (``tokenizer.*``
keys copied whole; the table uses SmolLM2's, 49,152 tokens), so both engines tokenize alike and the
embedding is [vocab, hidden]. Matrices are drawn N(0, 1/K) (K: their input width); norms are ones.
Q8_0, F16 and BF16 go through gguf-py's quantizers. gguf-py (0.19) has no Q4_K quantizer
(``gguf.quants.quantize`` raises NotImplementedError), so Q4_K tensors are random Q4_K blocks drawn
directly: per 32-value group a 6-bit scale s in [16, 63] and min m = s, per super-block d with
dmin = 7.5 d, 4-bit codes uniform: values d*s*(q - 7.5), zero mean, std ~1/sqrt(K). Any valid
encoding serves a speed comparison; both engines dequantize the same bytes.

    python -m client.tools.peers.synthetic_gguf qwen3 --type Q8_0 --tokenizer-from SmolLM2.gguf --out q.gguf
    python -m client.tools.peers.synthetic_gguf float-copy --type BF16 --source SmolLM2.Q4_1.gguf --out s.gguf
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import numpy as np


@dataclass(frozen=True)
class Shape:
    arch: str  # GGUF architecture: qwen3 | qwen3moe
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int  # dense FFN width (qwen3moe: llama.cpp's feed_forward_length, unused by its graph)
    experts: int = 0
    experts_used: int = 0
    expert_ffn: int = 0
    context: int = 40960  # Qwen3's; the table decodes at 8,192


QWEN3_0_6B = Shape("qwen3", layers=28, hidden=1024, heads=16, kv_heads=8, head_dim=128, ffn=3072)
QWEN3_MOE = Shape("qwen3moe", layers=16, hidden=1024, heads=16, kv_heads=8, head_dim=128, ffn=3072,
                  experts=32, experts_used=4, expert_ffn=384)
# the tests' versions: K-quant rows are whole 256-value super-blocks
TINY_QWEN3 = Shape("qwen3", layers=2, hidden=256, heads=4, kv_heads=2, head_dim=64, ffn=512, context=4096)
TINY_QWEN3_MOE = Shape("qwen3moe", layers=2, hidden=256, heads=4, kv_heads=2, head_dim=64, ffn=512,
                       experts=4, experts_used=2, expert_ffn=512, context=4096)
SHAPES = {"qwen3-0.6b": QWEN3_0_6B, "qwen3moe": QWEN3_MOE, "tiny-qwen3": TINY_QWEN3, "tiny-qwen3moe": TINY_QWEN3_MOE}
MATRIX_TYPES = ("Q8_0", "Q4_K")
FLOAT_TYPES = ("F16", "BF16")
FILE_TYPES = {"Q8_0": 7, "Q4_K": 15, "F16": 1, "BF16": 32}  # llama_ftype: MOSTLY_Q8_0, _Q4_K_M, _F16, _BF16


def copy_fields(reader, writer, keep) -> None:
    """Every key-value field of ``reader`` whose name ``keep`` accepts, with its own type."""
    import gguf
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or not keep(field.name):
            continue
        array = field.types[0] == gguf.GGUFValueType.ARRAY
        writer.add_key_value(field.name, field.contents(), field.types[0],
                             sub_type=field.types[-1] if array else None)


def random_q4_k(rng: np.random.Generator, rows: int, k: int) -> np.ndarray:
    """[rows, k] random Q4_K blocks ([rows, k / 256 * 144] bytes) of zero mean and std ~1/sqrt(k)."""
    if k % 256:
        raise ValueError(f"Q4_K needs rows of whole 256-value super-blocks; this matrix's rows are {k}")
    nb = rows * (k // 256)
    sc = rng.integers(16, 64, (nb, 8), dtype=np.uint8)
    m = sc  # min = 7.5 d * s  ->  value d*s*(q - 7.5)
    q = rng.integers(0, 16, (nb, 4, 2, 32), dtype=np.uint8)  # 4 chunks of 64: low nibbles then high
    code_std = np.sqrt((16 ** 2 - 1) / 12)
    d = np.full(nb, 1 / (np.sqrt(k) * code_std * 40), np.float32).astype(np.float16)  # s ~ 40 on average
    dmin = (d.astype(np.float32) * 7.5).astype(np.float16)
    scales = np.concatenate([(sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6), (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6),
                             (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)], axis=1)
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(nb, 128)
    blocks = np.concatenate([d.view(np.uint8).reshape(nb, 2), dmin.view(np.uint8).reshape(nb, 2), scales, qs], axis=1)
    return blocks.reshape(rows, -1)


def _add_matrix(writer, name: str, rng: np.random.Generator, shape: tuple[int, ...], qtype: str) -> None:
    """A random matrix (or a stack of them: [E, N, K]) of ``qtype``."""
    import gguf
    from gguf import GGMLQuantizationType as T
    rows, k = int(np.prod(shape[:-1])), shape[-1]
    if qtype == "Q4_K":
        data = random_q4_k(rng, rows, k)
    else:
        w = rng.standard_normal((rows, k), dtype=np.float32) / np.float32(np.sqrt(k))
        data = gguf.quants.quantize(w, T[qtype])
    writer.add_tensor(name, data.reshape(*shape[:-1], -1), raw_dtype=T[qtype])


def write_synthetic(path: Path, shape: Shape, qtype: str, tokenizer_from: Path, seed: int = 0,
                    embedding_type: Optional[str] = None) -> Path:
    """A random ``shape`` model in ``qtype`` (Q8_0 or Q4_K; the embedding ``embedding_type``, default
    the same) whose tokenizer is ``tokenizer_from``'s. Returns ``path``."""
    import gguf
    if qtype not in MATRIX_TYPES:
        raise ValueError(f"--type {qtype!r}: the synthetic files are written in {', '.join(MATRIX_TYPES)}")
    rng = np.random.default_rng(seed)
    source = gguf.GGUFReader(str(tokenizer_from))
    vocab = len(source.fields["tokenizer.ggml.tokens"].data)
    s = shape
    writer = gguf.GGUFWriter(str(path), s.arch)
    writer.add_name(f"synthetic {s.arch} ({s.layers} layers, hidden {s.hidden}, {qtype}, seed {seed})")
    writer.add_file_type(FILE_TYPES[qtype])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_block_count(s.layers)
    writer.add_context_length(s.context)
    writer.add_embedding_length(s.hidden)
    writer.add_feed_forward_length(s.ffn)
    writer.add_head_count(s.heads)
    writer.add_head_count_kv(s.kv_heads)
    writer.add_key_length(s.head_dim)
    writer.add_value_length(s.head_dim)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(1000000.0)
    if s.experts:
        writer.add_expert_count(s.experts)
        writer.add_expert_used_count(s.experts_used)
        writer.add_expert_feed_forward_length(s.expert_ffn)
        writer.add_expert_weights_norm(True)
    copy_fields(source, writer, lambda name: name.startswith("tokenizer."))
    ones = lambda n: np.ones(n, np.float32)  # noqa: E731
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    _add_matrix(writer, "token_embd.weight", rng, (vocab, s.hidden), embedding_type or qtype)
    writer.add_tensor("output_norm.weight", ones(s.hidden))
    for i in range(s.layers):
        b = f"blk.{i}."
        writer.add_tensor(b + "attn_norm.weight", ones(s.hidden))
        for name, shape_ in (("attn_q", (q, s.hidden)), ("attn_k", (kv, s.hidden)), ("attn_v", (kv, s.hidden)),
                             ("attn_output", (s.hidden, q))):
            _add_matrix(writer, b + name + ".weight", rng, shape_, qtype)
        writer.add_tensor(b + "attn_q_norm.weight", ones(s.head_dim))
        writer.add_tensor(b + "attn_k_norm.weight", ones(s.head_dim))
        writer.add_tensor(b + "ffn_norm.weight", ones(s.hidden))
        if s.experts:
            router = rng.standard_normal((s.experts, s.hidden), dtype=np.float32) / np.float32(np.sqrt(s.hidden))
            writer.add_tensor(b + "ffn_gate_inp.weight", router)
            for name, shape_ in (("ffn_gate_exps", (s.experts, s.expert_ffn, s.hidden)),
                                 ("ffn_up_exps", (s.experts, s.expert_ffn, s.hidden)),
                                 ("ffn_down_exps", (s.experts, s.hidden, s.expert_ffn))):
                _add_matrix(writer, b + name + ".weight", rng, shape_, qtype)
        else:
            for name, shape_ in (("ffn_gate", (s.ffn, s.hidden)), ("ffn_up", (s.ffn, s.hidden)),
                                 ("ffn_down", (s.hidden, s.ffn))):
                _add_matrix(writer, b + name + ".weight", rng, shape_, qtype)
    _finish(writer)
    return Path(path)


def write_float_copy(path: Path, source: Path, ftype: str) -> Path:
    """``source`` with every matrix dequantized by gguf-py and stored as ``ftype`` (F16 or BF16); 1-D
    tensors as they are; every key but the file type copied. Returns ``path``."""
    import gguf
    from gguf import GGMLQuantizationType as T
    if ftype not in FLOAT_TYPES:
        raise ValueError(f"--type {ftype!r}: a float copy is written in {', '.join(FLOAT_TYPES)}")
    reader = gguf.GGUFReader(str(source))
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(path), arch)
    copy_fields(reader, writer, lambda name: name not in ("general.architecture", "general.file_type"))
    writer.add_file_type(FILE_TYPES[ftype])
    for t in reader.tensors:
        shape = tuple(reversed([int(x) for x in t.shape]))
        if len(shape) < 2:
            writer.add_tensor(t.name, np.asarray(t.data))
            continue
        values = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape).astype(np.float32)
        if ftype == "F16":
            writer.add_tensor(t.name, values.astype(np.float16))
        else:
            writer.add_tensor(t.name, gguf.quants.quantize(values, T.BF16), raw_dtype=T.BF16)
    _finish(writer)
    return Path(path)


def _finish(writer) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m client.tools.peers.synthetic_gguf", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("kind", choices=("qwen3", "qwen3moe", "float-copy"))
    p.add_argument("--type", required=True, help=f"qwen3/qwen3moe: {', '.join(MATRIX_TYPES)}; "
                   f"float-copy: {', '.join(FLOAT_TYPES)}")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--tokenizer-from", type=Path, help="qwen3/qwen3moe: the GGUF file whose tokenizer.* keys are copied")
    p.add_argument("--source", type=Path, help="float-copy: the GGUF file to re-write")
    p.add_argument("--shape", choices=sorted(SHAPES), help="default qwen3-0.6b / qwen3moe")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    try:
        if args.kind == "float-copy":
            if args.source is None:
                p.error("float-copy needs --source")
            write_float_copy(args.out, args.source, args.type)
        else:
            if args.tokenizer_from is None:
                p.error(f"{args.kind} needs --tokenizer-from")
            shape = SHAPES[args.shape or ("qwen3-0.6b" if args.kind == "qwen3" else "qwen3moe")]
            if shape.arch != args.kind:
                p.error(f"--shape {args.shape} is a {shape.arch} shape, not {args.kind}")
            write_synthetic(args.out, shape, args.type, args.tokenizer_from, args.seed)
    except (ValueError, OSError) as exc:
        print(f"synthetic_gguf: {exc}", file=sys.stderr)
        return 2
    print(f"synthetic_gguf: wrote {args.out} ({args.out.stat().st_size / 2**20:.1f} MiB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
