# downpour — the two set-up commands are `make run-local` and `make test`.
# Each target creates .venv and installs the project into it when needed; a stamp
# file per extra makes the second run instant.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check -q
WORKERS ?= 2
ARGS   ?=

.PHONY: run-local test test-slow lint bench clean venv

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip setuptools wheel

$(VENV)/.stamp-base: pyproject.toml | $(VENV)/bin/python
	$(PIP) install -e .
	touch $@

$(VENV)/.stamp-test: pyproject.toml $(VENV)/.stamp-base
	$(PIP) install -e '.[test]'
	touch $@

venv: $(VENV)/.stamp-base

run-local: $(VENV)/.stamp-base
	$(VENV)/bin/downpour run-local --workers $(WORKERS) $(ARGS)

test: $(VENV)/.stamp-test
	$(PY) -m pytest -q -ra

test-slow: $(VENV)/.stamp-test
	$(PY) -m pytest -q -ra -m slow

lint: $(VENV)/.stamp-test
	$(VENV)/bin/ruff check services shared tests
	$(VENV)/bin/ruff format --check services shared tests

clean:
	rm -rf $(VENV) runs build *.egg-info .pytest_cache .ruff_cache
