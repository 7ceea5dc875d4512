# Two entry points for a fresh machine: `make run` and `make test`.
# Each target installs what it needs into $(VENV), once: `run` the package, `test` and `lint` the
# `test` extra, `bench` the `bench` extra, `install-dev` everything (test, bench, eval).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
MIN_PYTHON := 3.11
# pytest-xdist workers for the fast tier (its tests are process-local; the Ray tier stays serial).
FAST_WORKERS ?= 2

# The verifiers and the pure code: no Ray, no servers, nothing long (tests marked `ray` or `slow`
# are left out). The rest is what `make test` adds after it.
FAST_MARKS := not ray and not slow
REST_MARKS := ray or slow

.PHONY: install install-dev check-python run test test-fast test-rest lint bench gpu-check protos clean

# Refuses an interpreter older than the package supports (pyproject.toml's requires-python).
define CHECK_PYTHON
$(PYTHON) -c 'import sys; sys.exit(sys.version_info < tuple(map(int, "$(MIN_PYTHON)".split("."))))' 2>/dev/null || { \
	echo "specserve needs Python >= $(MIN_PYTHON); PYTHON=$(PYTHON) is $$($(PYTHON) --version 2>/dev/null || echo 'not found')." >&2; \
	echo "Run make with PYTHON=python$(MIN_PYTHON) (or newer)." >&2; \
	exit 1; }
endef

check-python:
	@$(CHECK_PYTHON)

# The venv with torch (CPU wheel pinned as in pyproject.toml) and the package itself; the Python
# version is checked before the venv is made from it.
$(VENV)/.base: pyproject.toml
	@$(CHECK_PYTHON)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip
	$(BIN)/pip install torch==2.13.0
	$(BIN)/pip install -e .
	touch $@

# One stamp per extra: `make test` never pulls the bench or eval dependencies.
.SECONDARY: $(VENV)/.extra-test $(VENV)/.extra-bench $(VENV)/.extra-dev
$(VENV)/.extra-%: $(VENV)/.base
	$(BIN)/pip install -e '.[$*]'
	touch $@

# What CI and `make test` use: the package and its test extra.
install: $(VENV)/.extra-test

# A developer's full set: test, bench (plots) and eval (lm-evaluation-harness).
install-dev: $(VENV)/.extra-dev

run: $(VENV)/.base
	$(BIN)/specserve serve --config deploy/default.yaml

# The whole suite, the fast tier first: a broken verifier fails in minutes, before Ray starts.
test: $(VENV)/.extra-test
	$(MAKE) --no-print-directory test-fast
	$(MAKE) --no-print-directory test-rest

test-fast: $(VENV)/.extra-test
	$(BIN)/python -m pytest tests -m "$(FAST_MARKS)" -q -n $(FAST_WORKERS)

# Everything test-fast leaves out: one process, one Ray instance for the session.
test-rest: $(VENV)/.extra-test
	$(BIN)/python -m pytest tests -m "$(REST_MARKS)"

lint: $(VENV)/.extra-test
	$(BIN)/ruff check .

bench: $(VENV)/.extra-bench
	$(BIN)/specserve bench --config deploy/default.yaml --out bench-out

# The checks for a GPU's first lending (benchmarks/gpu_check.py); DRY=1: the same pipeline on CPU, tiny shapes.
gpu-check: $(VENV)/.extra-test
	$(BIN)/python -m benchmarks.gpu_check $(if $(DRY),--dry-run)

# Regenerate the committed gRPC stubs from protos/specserve.proto (tests/protos checks them).
protos: $(VENV)/.extra-test
	$(BIN)/python -m protos.generate

clean:
	rm -rf $(VENV) bench-out
