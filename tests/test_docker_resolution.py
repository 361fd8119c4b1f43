"""The Docker image's pip installs resolve for the base image's Python: the Dockerfile's whole
install set (torch at its ARG version, the project's dependencies from pyproject.toml, and what the
project's `pip install` line adds) through `pip install --dry-run` for that Python and a manylinux
x86_64 platform, binary wheels only, as the image would fetch them. No Docker engine is needed; the
network reached is PyPI (metadata only). torch is resolved from PyPI: the image takes the CUDA 12.8
build of the same version from PyTorch's index, which has the same dependencies on the project's
side (triton 3.7.1) and which this machine cannot reach.

The base image's Python comes from NVIDIA's release notes ("Contents of the Triton Inference
Server container"): 24.10 ships Ubuntu 22.04 with Python 3.10, 24.12 Ubuntu 24.04 with Python 3.12.
"""
import json
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
IMAGE_PYTHON = {"nvcr.io/nvidia/tritonserver:24.10-py3": "3.10", "nvcr.io/nvidia/tritonserver:24.12-py3": "3.12"}
# Ubuntu 24.04's glibc is 2.39: every manylinux tag up to it
PLATFORMS = [f"manylinux_2_{minor}_x86_64" for minor in range(17, 40)] + ["manylinux2014_x86_64"]


def dockerfile_install_set(text: str) -> tuple[str, list[str]]:
    """(the base image, the requirements its pip installs ask for), ARGs substituted."""
    text = text.replace("\\\n", " ")
    base = re.search(r"^FROM\s+(\S+)", text, re.M).group(1)
    args = dict(re.findall(r"^ARG\s+(\w+)=(\S+)", text, re.M))
    reqs = []
    for command in re.findall(r"^RUN\s+(.*)$", text, re.M):
        for part in command.split("&&"):
            words = shlex.split(re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], part))
            if words[:4] != ["python3", "-m", "pip", "install"]:
                continue
            skip = False
            for word in words[4:]:
                if skip:
                    skip = False
                elif word.startswith("--"):
                    skip = "=" not in word          # an option's value follows (--index-url URL)
                elif word == "/opt/inflight":       # the project: its dependencies
                    reqs += tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
                else:
                    reqs.append(word)
    return base, reqs


def test_the_install_set_is_read_from_the_dockerfile():
    base, reqs = dockerfile_install_set((ROOT / "Dockerfile").read_text())
    assert base in IMAGE_PYTHON, f"the base image {base}'s Python is not known here: add it from the release notes"
    assert reqs[0] == "torch==2.13.0" and any(r.startswith("transformers==") for r in reqs)
    assert "fastapi==0.163.2" in reqs and not any(r.startswith("nvidia-pytriton") for r in reqs)


@pytest.mark.slow
def test_the_images_pip_installs_resolve_for_its_python(tmp_path):
    base, reqs = dockerfile_install_set((ROOT / "Dockerfile").read_text())
    python = IMAGE_PYTHON[base]
    report = tmp_path / "report.json"
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--target", str(tmp_path / "never"),
           "--report", str(report), "--python-version", python, "--implementation", "cp",
           "--abi", "cp" + python.replace(".", ""), "--only-binary=:all:",
           *[f"--platform={p}" for p in PLATFORMS], *reqs]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"{base} (Python {python}) cannot install {reqs}:\n{proc.stderr[-3000:]}"
    installed = {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in json.loads(report.read_text())["install"]}
    assert installed["torch"] == "2.13.0" and installed["transformers"] == "5.24.0"
    assert installed["triton"].startswith("3.7")           # what torch 2.13's CUDA builds require
    assert not (tmp_path / "never").exists()
