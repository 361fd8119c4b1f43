#!/usr/bin/env bash
# The container's entrypoint (see the Dockerfile): serve the model repository in INFLIGHT_HOME
# (default /workspace, the mounted repository; the Kubernetes manifests use the copy in the image).
# On first start it writes the default model into models/default and renders
# model_repository/llm/config.pbtxt (KIND_GPU on the GPUs it sees) when they are missing, then
# runs tritonserver. Arguments go to tritonserver (e.g. --log-verbose=1).
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
