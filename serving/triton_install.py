"""Where the local `tritonserver` is and what it needs to run (docs/design.md, "Running Triton
locally"): the nvidia-pytriton wheel's binary, its backends and bundled libraries (or NVIDIA's
tritonserver image's own), the Python backend stub for the running interpreter's version in
`backends/python/`, and the environment that puts the interpreter's `libpython` first on
`LD_LIBRARY_PATH`, then the wheel's libraries. serving/triton_launcher.py starts the server with them.
"""
from __future__ import annotations

import os
import shutil
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional


class ServerError(RuntimeError):
    """tritonserver could not be started, or the model did not become ready."""


@dataclass(frozen=True)
class TritonInstall:
    binary: Path
    backend_dir: Path
    lib_dirs: tuple[Path, ...]


def find_tritonserver() -> TritonInstall:
    """Locate the tritonserver binary, its backends and its bundled libraries in nvidia-pytriton."""
    try:
        import pytriton  # noqa: F401  (only its location is needed)
    except ImportError as exc:
        system = Path(shutil.which("tritonserver") or "/opt/tritonserver/bin/tritonserver")
        if system.is_file():  # NVIDIA's tritonserver image: its own server, backends and stub
            return TritonInstall(binary=system, backend_dir=system.resolve().parents[1] / "backends", lib_dirs=())
        raise ServerError("the local tritonserver comes with nvidia-pytriton: "
                          "run `make setup` (or pip install -e '.[server]')") from exc
    pkg = Path(pytriton.__file__).resolve().parent
    root = pkg / "tritonserver"
    binary = root / "bin" / "tritonserver"
    if not binary.is_file():
        raise ServerError(f"no tritonserver binary at {binary}")
    libs = pkg.parent / "nvidia_pytriton.libs"
    return TritonInstall(binary=binary, backend_dir=root / "backends",
                         lib_dirs=tuple(p for p in (libs,) if p.is_dir()))


def ensure_python_stub(install: TritonInstall) -> Path:
    """Put the running interpreter's Python-backend stub in backends/python/ (once).

    Returns the backend directory to pass to tritonserver. When site-packages is read-only, the
    Python backend is copied into a user cache folder with the stub beside it.
    """
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = install.backend_dir.parent / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.parent.parent.is_dir() and (install.backend_dir / "python" / stub.name).is_file():
        return install.backend_dir  # a server built for this Python (the tritonserver image)
    if not stub.is_file():
        raise ServerError(f"nvidia-pytriton ships no Python backend stub for Python {version} ({stub})")
    target = install.backend_dir / "python" / stub.name
    if _same_file(stub, target):
        return install.backend_dir
    try:
        _copy_executable(stub, target)
        return install.backend_dir
    except OSError:
        pass
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "inflight" / f"backends-py{version}"
    if not _same_file(stub, cache / "python" / stub.name):
        shutil.copytree(install.backend_dir / "python", cache / "python", dirs_exist_ok=True)
        _copy_executable(stub, cache / "python" / stub.name)
    return cache


def _same_file(a: Path, b: Path) -> bool:
    return b.is_file() and a.stat().st_size == b.stat().st_size and a.read_bytes() == b.read_bytes()


def _copy_executable(src: Path, dst: Path) -> None:
    tmp = dst.with_name(dst.name + f".tmp{os.getpid()}")
    shutil.copyfile(src, tmp)
    tmp.chmod(0o755)
    os.replace(tmp, dst)  # atomic: a concurrent start never sees half a stub


def server_env(install: TritonInstall, base: Optional[Mapping[str, str]] = None) -> dict[str, str]:
    """The environment tritonserver and its stubs need: libpython first, then the wheel's libs.

    The stub embeds libpython and ignores PYTHONPATH; like `python3` it finds its prefix (and so a
    venv's site-packages, through pyvenv.cfg) from `python3` on PATH. So the running interpreter's
    folder goes first on PATH: the stub then sees this very environment (torch, the editable
    install of this repository).
    """
    env = dict(os.environ if base is None else base)
    libdir = sysconfig.get_config_var("LIBDIR")
    ld = [d for d in [libdir, *map(str, install.lib_dirs)] if d]
    if env.get("LD_LIBRARY_PATH"):
        ld.append(env["LD_LIBRARY_PATH"])
    env["LD_LIBRARY_PATH"] = os.pathsep.join(ld)
    bindir = str(Path(sys.executable).parent)
    env["PATH"] = os.pathsep.join([bindir] + [p for p in env.get("PATH", "").split(os.pathsep)
                                              if p and p != bindir])
    return env
