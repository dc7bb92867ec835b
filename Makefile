# Two commands on a fresh clone: `make demo` and `make test`. `.venv` is a file target: it is rebuilt
# only when pyproject.toml changes.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: test demo serve lint browser clean

$(VENV): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(VENV)

# The suite's modules on TEST_WORKERS processes (pytest-xdist), each module whole on one of them (its module
# fixtures, servers and Redis, started once): many tests wait on servers and subprocesses, so two processes keep
# two cores busy. Their OpenMP threads wait asleep (tests/conftest.py sets OMP_WAIT_POLICY), not spinning on the
# core the other process needs.
TEST_WORKERS ?= 2

test: $(VENV) browser
	$(BIN)/ruff check engine api pipeline jobqueue cli tests bench memory
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile tests

demo: $(VENV)
	$(BIN)/vlmcap demo

serve: $(VENV)
	$(BIN)/vlmcap serve --model tiny

lint: $(VENV)
	$(BIN)/ruff check engine api pipeline jobqueue cli tests bench memory

# Headless Chromium for the dashboard's browser tests: Debian's package (Playwright never downloads one).
browser:
	@test -x /usr/bin/chromium || { apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; }

clean:
	rm -rf $(VENV) .pytest_cache
