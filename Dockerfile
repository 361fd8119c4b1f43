# syntax=docker/dockerfile:1.6
# inflight on NVIDIA's Triton Inference Server image (Triton 2.51, Python backend, Python 3.10).
#
#   docker build -t inflight .
#   docker run --gpus all --rm -p8000:8000 -p8001:8001 -p8002:8002 -v $PWD:/workspace inflight
#
# The container serves /workspace/model_repository (the mounted repository): on first start it
# writes the default model into models/default and renders model_repository/llm/config.pbtxt
# (KIND_GPU on the GPUs it sees) when they are missing, then runs tritonserver. Arguments after
# the image name go to tritonserver (e.g. --log-verbose=1).
FROM nvcr.io/nvidia/tritonserver:24.10-py3

ARG TORCH_VERSION=2.13.0
# The PyTorch wheel index of the CUDA build to install (same torch version as the CPU pin).
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu128

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1

# CUDA torch first, so the project's torch==2.13.0 pin is already met by the +cuXXX build. It brings
# the triton compiler it was built with (3.7.1), which pyproject's triton range accepts: the
# project install below keeps it. This image's Python is 3.10; pyproject's markers pick the
# versions that still support it (matplotlib 3.10).
RUN python3 -m pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX}"

WORKDIR /opt/inflight
COPY pyproject.toml README.md ./
COPY backend/ backend/
COPY kernels/ kernels/
COPY client/ client/
COPY templates/ templates/
COPY model_repository/ model_repository/
# The project and its dependencies (the image has its own tritonserver: no nvidia-pytriton).
RUN python3 -m pip install /opt/inflight && python3 -c "import torch, backend, client.cli"

COPY <<'EOF' /usr/local/bin/inflight-entrypoint
#!/usr/bin/env bash
set -euo pipefail
cd "${INFLIGHT_HOME:-/workspace}"
if [ ! -f model_repository/llm/1/model.py ]; then
  echo "inflight: no model_repository/llm/1/model.py in $PWD; mount the repository: -v \$PWD:/workspace" >&2
  exit 2
fi
[ -f models/default/config.json ] || inflight make-model --out models/default
# Renders config.pbtxt if missing (KIND_GPU on the GPUs seen); keeps a hand-edited one.
inflight config --output model_repository/llm/config.pbtxt
exec tritonserver --model-repository="$PWD/model_repository" --disable-auto-complete-config "$@"
EOF
RUN chmod +x /usr/local/bin/inflight-entrypoint

WORKDIR /workspace
EXPOSE 8000 8001 8002
ENTRYPOINT ["/usr/local/bin/inflight-entrypoint"]
