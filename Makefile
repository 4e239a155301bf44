# Two entry points: `make run` (the whole pipeline on profiles/local.yaml) and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PROFILE ?= local
ARGS ?=

.PHONY: run test test-all lint setup bench clean

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $@

setup: $(BIN)/.installed

run: setup
	$(BIN)/trainpipe run -p $(PROFILE) $(ARGS)

test: lint
	$(BIN)/python -m pytest $(ARGS)

test-all: lint
	$(BIN)/python -m pytest -m "extended or not extended" $(ARGS)

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

bench: setup
	$(BIN)/python benchmarks/step_overhead.py

clean:
	rm -rf .trainpipe
