# ucpd — `make demo` runs the main job, `make test` the tests. Both set everything up first.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
NATIVE := $(shell find native -type f 2>/dev/null) CMakeLists.txt pyproject.toml

.PHONY: setup test test-fast demo bench clean

setup: $(STAMP)

# torch==2.13.0 (a CPU wheel pip finds locally) goes in first and alone: anything that pulls a
# bare `torch` into an empty environment would fetch GBs of CUDA packages instead.
$(STAMP): $(NATIVE)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q "scikit-build-core>=0.10" "nanobind>=2.0"
	$(BIN)/python -m pip install -q --no-build-isolation -e ".[test]"
	# tested through the real libraries; their wheels require torch, so --no-deps keeps the one above
	$(BIN)/python -m pip install -q --no-deps "accelerate==1.15.0" "torchft==0.2.0" "lightning==2.6.6" "torchmetrics==1.9.0"
	# lightning's own dependencies that do not require torch (its wheel also names pytorch-lightning, which it does not import)
	$(BIN)/python -m pip install -q "lightning-utilities>=0.10,<2" "fsspec>=2022.5" "packaging>=23"
	$(BIN)/python -m pip install -q "opentelemetry-api>=1.30" "opentelemetry-sdk>=1.30" "opentelemetry-exporter-otlp-proto-http>=1.30"
	touch $@

# Tests run in parallel (pytest-xdist): each test has its own run, shm and temp dirs
# (tests/conftest.py), and most of a team test's time is spent waiting on other processes.
# worksteal rebalances the long multi-process scenarios; TEST_WORKERS=0 runs them one by one.
TEST_WORKERS ?= 3
PYTEST := $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist worksteal

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

clean:
	rm -rf build $(VENV) .pytest_cache .hypothesis
