# Two commands on a fresh clone: `make demo` and `make test`. `.venv` is a file target: it is rebuilt
# only when pyproject.toml changes.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: test demo serve lint bench-stall bench-peers clean

$(VENV): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(VENV)

test: $(VENV)
	$(BIN)/ruff check engine api pipeline tests bench
	$(BIN)/python -m pytest -q tests

demo: $(VENV)
	$(BIN)/vlmcap demo

serve: $(VENV)
	$(BIN)/vlmcap serve --model tiny

lint: $(VENV)
	$(BIN)/ruff check engine api pipeline tests bench

clean:
	rm -rf $(VENV) .pytest_cache
