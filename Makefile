# Two entry points for a fresh machine: `make run` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install run test test-fast lint bench protos clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip
	$(BIN)/pip install torch==2.13.0
	$(BIN)/pip install -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(BIN)/specserve serve --config deploy/default.yaml

test: $(STAMP)
	$(BIN)/python -m pytest tests

# The verifiers and the pure code: no Ray, no servers (tests marked `ray` are left out).
test-fast: $(STAMP)
	$(BIN)/python -m pytest tests -m "not ray" -q -n 2

lint: $(STAMP)
	$(BIN)/ruff check .

bench: $(STAMP)
	$(BIN)/specserve bench --config deploy/default.yaml --out bench-out

# Regenerate the committed gRPC stubs from protos/specserve.proto (tests/protos checks them).
protos: $(STAMP)
	$(BIN)/python -m protos.generate

clean:
	rm -rf $(VENV) bench-out
