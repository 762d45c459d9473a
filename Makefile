# kvtier developer entry points. `make setup` is idempotent and fast once everything is installed.
VENV       ?= .venv
PY         := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: help setup test test-fast demo lint model

help:
	@echo "make setup      install system packages, .venv, dependencies and the test model"
	@echo "make test       setup, then the whole test suite (pytest -q)"
	@echo "make test-fast  setup, then the tests not marked slow"
	@echo "make demo       setup, then the main job (kvtier demo: multi-turn chat, kvtier vs vLLM alone)"
	@echo "make lint       ruff + mypy"

setup:
	@bash scripts/setup.sh

test: setup
	$(PY) -m pytest -q $(PYTEST_ARGS)

test-fast: setup
	$(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS)

# Main job: a multi-turn chat on the embedded SmolLM2 with a small device KV cache, served with
# kvtier (host tier + fs tier in a temp dir) and without it; per-turn TTFT and where each prompt's
# KV came from (BENCHMARKS.md). DEMO_ARGS="--json" for one JSON object.
DEMO_ARGS  ?=
demo: setup
	$(VENV)/bin/kvtier demo $(DEMO_ARGS)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy kvtier

model:
	@$(PY) scripts/prepare_model.py
