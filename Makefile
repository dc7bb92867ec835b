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

test: $(VENV) browser
	$(BIN)/ruff check engine api pipeline jobqueue cli tests bench memory
	$(BIN)/python -m pytest -q tests

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
