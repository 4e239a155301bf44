# Two entry points: `make run` (the whole pipeline on profiles/local.yaml) and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PROFILE ?= local
ARGS ?=

.PHONY: run test quick lint setup bench clean

# uv resolves, unpacks and byte-compiles on every core: 55 s on 2 cores where pip and compileall took 80. It reads
# no pip.conf, so it is handed pip's find-links (where a CPU wheel of torch may lie on disk); should uv be
# unavailable or fail, pip installs as before. Byte-compiled site-packages matter where PYTHONDONTWRITEBYTECODE is
# set: every process of the test suite would otherwise compile torch's and MLflow's modules in memory.
$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	( $(BIN)/python -m pip install --quiet uv && \
	  UV_FIND_LINKS="$${PIP_FIND_LINKS:-$$($(BIN)/python -m pip config get global.find-links 2>/dev/null)}" \
	  $(BIN)/uv pip install --python $(BIN)/python --quiet --compile-bytecode -e '.[dev]' ) || \
	( $(BIN)/python -m pip install --quiet --no-compile -e '.[dev]' && \
	  { $(BIN)/python -m compileall -q -j 0 $$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') >/dev/null || true; } )
	touch $@

setup: $(BIN)/.installed

run: setup
	$(BIN)/trainpipe run -p $(PROFILE) $(ARGS)

# Two workers: a serial run waits on processes, servers and timeouts half its time; a third (-n 3, 15:21 against
# 14:49) only adds contention on 2 cores. The project's own modules are byte-compiled first: where
# PYTHONDONTWRITEBYTECODE is set, each of the suite's hundreds of processes would compile them again in memory.
test: lint
	$(BIN)/python -m compileall -q -j 0 flows tasks trainer >/dev/null
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
