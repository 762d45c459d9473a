# kvtier developer entry points. `make setup` is idempotent and fast once everything is installed.
VENV       ?= .venv
PY         := $(VENV)/bin/python
PYTEST_ARGS ?=
DEMO_ROOT  ?=

.PHONY: help setup test test-fast demo lint model

help:
	@echo "make setup      install system packages, .venv, dependencies and the test model"
	@echo "make test       setup, then the whole test suite (pytest -q)"
	@echo "make test-fast  setup, then the tests not marked slow"
	@echo "make demo       setup, then the main job (fs tier benchmark)"
	@echo "make lint       ruff + mypy"

setup:
	@bash scripts/setup.sh

test: setup
	$(PY) -m pytest -q $(PYTEST_ARGS)

test-fast: setup
	$(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS)

# Main job: fs-tier write/read benchmark, 64 chunks of 2 MiB with 4 threads, in a temp dir
# (or DEMO_ROOT=/some/dir to benchmark another disk).
demo: setup
	@root="$(DEMO_ROOT)"; cleanup=; \
	if [ -z "$$root" ]; then root="$$(mktemp -d -t kvtier-demo.XXXXXX)"; cleanup="$$root"; fi; \
	trap 'if [ -n "$$cleanup" ]; then rm -rf "$$cleanup"; fi' EXIT; \
	echo "$(VENV)/bin/kvtier tier-bench --tier fs --root $$root --chunk-bytes 2097152 --chunks 64 --threads 4"; \
	$(VENV)/bin/kvtier tier-bench --tier fs --root "$$root" --chunk-bytes 2097152 --chunks 64 --threads 4

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy kvtier

model:
	@$(PY) scripts/prepare_model.py
