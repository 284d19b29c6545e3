# Two commands set up a fresh machine: `make run` and `make test`.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STATE   ?= $(CURDIR)/state
# The CPU build of torch is pinned first, so nothing pulls a multi-GB CUDA build.
TORCH   ?= torch==2.13.0
PYTEST_ARGS ?=

export MESHD_STATE_DIR := $(STATE)
export MESHD_TEST_MODEL_DIR := $(STATE)/models/smollm2-135m

.PHONY: run test bootstrap model gemma bench clean

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

test: model gemma
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

bench: model
	$(BIN)/python -m pip install -q -e ".[test,bench]"
	$(BIN)/python bench/bench_single.py
	$(BIN)/python bench/bench_throughput.py

clean:
	rm -rf $(VENV) build *.egg-info
