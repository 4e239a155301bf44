# Two entry points: `make run` (the whole pipeline on profiles/local.yaml) and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PROFILE ?= local
ARGS ?=

.PHONY: run test quick lint setup bench clean

# pip byte-compiles what it installs on one core; compileall does it on every core (25 s sooner on 2). A file
# written for a newer Python (torch ships some) fails to compile under both, and is left as pip leaves it.
$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --no-compile -e '.[dev]'
	$(BIN)/python -m compileall -q -j 0 $$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') >/dev/null || true
	touch $@

setup: $(BIN)/.installed

run: setup
	$(BIN)/trainpipe run -p $(PROFILE) $(ARGS)

test: lint  # two workers: half of a serial run's CPU time waits on processes, servers and timeouts
	$(BIN)/python -m pytest -n 2 $(ARGS)

quick: setup  # the development loop: pure logic only (no torchrun, servers or drills), under three minutes
	$(BIN)/python -m pytest -q -m "not distributed and not integration and not drill and not slow and not gpu" $(ARGS)

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/basedpyright $$(find -L links/trainpipe -name '*.py' -not -path '*/__pycache__/*' | sort)

bench: setup
	$(BIN)/python benchmarks/step_overhead.py

clean:
	rm -rf .trainpipe
