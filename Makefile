# Two commands set up a fresh machine: `make run` and `make test`.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STATE   ?= $(CURDIR)/state
# The CPU build of torch is pinned first, so nothing pulls a multi-GB CUDA build.
TORCH   ?= torch==2.13.0
# The suite runs in several workers (tests/fixtures/workers.py): most of its time is waiting on
# daemons, namespaces and timeouts, not the two cores. PYTEST_ARGS adds to it (e.g. -k mesh).
TEST_WORKERS ?= 6
PYTEST_ARGS ?=

export MESHD_STATE_DIR := $(STATE)
export MESHD_TEST_MODEL_DIR := $(STATE)/models/smollm2-135m

.PHONY: run test typecheck durations bootstrap model gemma bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[test]"
	touch $@

bootstrap: $(VENV)/.installed

model: bootstrap
	$(BIN)/meshd model fetch smollm2-135m --state-dir "$(STATE)"

# The second real model, which the family tests check against transformers.
gemma: bootstrap
	$(BIN)/meshd model fetch gemma3-270m --state-dir "$(STATE)"

run: model
	$(BIN)/meshd demo --peers 3 --state-dir "$(STATE)"

# One torch thread per process: six workers and their daemons share two cores, and libgomp's
# spinning threads in each would take turns burning them (tests that need a count say so).
test: model gemma typecheck
	OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder --durations=5 $(PYTEST_ARGS)

# Every function of meshd/, shards/ and protocol/ type-checked ([tool.mypy], untyped bodies too): zero errors.
typecheck: bootstrap
	$(BIN)/mypy

# Re-measure how long each test group takes (the order workers take them in).
durations: model gemma
	PYTEST_MESHD_DURATIONS=$(CURDIR)/tests/durations.json $(BIN)/python -m pytest -q -n $(TEST_WORKERS) \
		--dist loadgroup --no-loadscope-reorder $(PYTEST_ARGS)

bench: model
	$(BIN)/python -m pip install -q -e ".[test,bench]"
	$(BIN)/python bench/bench_single.py
	$(BIN)/python bench/bench_throughput.py

clean:
	rm -rf $(VENV) build *.egg-info
