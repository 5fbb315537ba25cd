# downpour — the two set-up commands are `make run-local` and `make test`.
# Each target creates .venv and installs the project into it when needed; a stamp
# file per extra makes the second run instant.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check -q
WORKERS ?= 2
SHARDS  ?= 1
ARGS   ?=

.PHONY: run-local test docs test-slow test-all test-faults soak lint bench bench-curve study clean venv \
	deploy-tools test-containers check-gpu

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip setuptools wheel

$(VENV)/.stamp-base: pyproject.toml | $(VENV)/bin/python
	$(PIP) install -e .
	touch $@

$(VENV)/.stamp-test: pyproject.toml $(VENV)/.stamp-base
	$(PIP) install -e '.[test]'
	touch $@

$(VENV)/.stamp-docs: pyproject.toml $(VENV)/.stamp-base
	$(PIP) install -e '.[docs]'
	touch $@

venv: $(VENV)/.stamp-base

run-local: $(VENV)/.stamp-base
	$(VENV)/bin/downpour run-local --workers $(WORKERS) --shards $(SHARDS) $(if $(filter 1,$(SECURE)),--secure) $(ARGS)

# Two test tiers. `make test`: the fast tier, a few minutes on 2 cores (services in-process on
# real loopback sockets; installs no system package). `make test-slow`: the slow tier (real
# service processes, faults, network namespaces, bench/study smoke, run-local, systemd units).
# `make test-all`: both (CI). -ra lists every skip with its reason; --durations the slowest
# tests, to keep each tier in its time budget. The fast tier runs on one pytest-xdist process
# per core (at most FAST_JOBS), a test file to a process so module fixtures are built once;
# the slow tier runs serially, since its benchmarks and soak measure with the cores to
# themselves.
FAST_JOBS ?= 4
FAST := -m "not slow" -n auto --maxprocesses $(FAST_JOBS) --dist loadfile
test: $(VENV)/.stamp-test
	$(PY) -m pytest -q -ra --durations=20 $(FAST)

# systemd-analyze for the slow tier's unit-file tests (Debian package systemd): test-slow and
# test-all install it once when missing and possible (root + apt-get), `make test` never does;
# otherwise those tests skip and say why.
deploy-tools:
	@command -v systemd-analyze >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null \
		&& apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq systemd >/dev/null; } \
		|| echo "deploy-tools: systemd-analyze unavailable; the unit-file tests will skip"

# The slow tier builds the docs site (tests/test_docs.py), so it installs the docs extra too.
test-slow: $(VENV)/.stamp-test $(VENV)/.stamp-docs deploy-tools
	$(PY) -m pytest -q -ra -m slow

# Both tiers run even when the first fails, so one CI run reports every failure.
test-all: $(VENV)/.stamp-test $(VENV)/.stamp-docs deploy-tools
	$(PY) -m pytest -q -ra --durations=20 $(FAST); fast=$$?; \
	$(PY) -m pytest -q -ra --durations=30 -m slow; slow=$$?; \
	[ $$fast = 0 ] && [ $$slow = 0 ]

# The container image built and run for real with podman (tests/test_containers.py, also in
# test-slow and test-all; it skips, saying why, where podman cannot run): a local base image
# made with debootstrap once (kept in podman's storage), the image build, compose up with a
# server and 2 workers on host networking, healthcheck, status, stop and resume from the
# checkpoint. Prints the image size and the time to the first applied update.
test-containers: $(VENV)/.stamp-test
	$(PY) -m pytest -q -ra -s -m containers tests/test_containers.py

# run-local on a GPU (--device gpu) where TensorFlow sees one (a CUDA build:
# .venv/bin/pip install 'tensorflow[and-cuda]'); elsewhere it says so and succeeds.
check-gpu: $(VENV)/.stamp-base
	@if $(PY) -c "import sys, tensorflow as tf; sys.exit(not tf.config.list_physical_devices('GPU'))" 2>/dev/null; then \
		echo "check-gpu: TensorFlow sees a GPU: run-local --device gpu"; \
		$(VENV)/bin/downpour run-local --device gpu --workers $(WORKERS) --epochs 1 --no-progress \
			--run-dir runs/check-gpu $(ARGS) \
		&& grep -h "computing on GPU" runs/check-gpu/server.log runs/check-gpu/worker-0.log; \
	else \
		echo "check-gpu: no GPU visible to TensorFlow on this machine: nothing to check (the CPU path is tested by make test: tests/test_device.py)"; \
	fi

# The long fault variants: fault tests of both tiers and 20,000 fuzz cases of the decoder
# (300 per fuzz test otherwise).
test-faults: $(VENV)/.stamp-test
	DOWNPOUR_FUZZ_EXAMPLES=20000 $(PY) -m pytest -q -ra -m "slow or not slow" \
		tests/test_wire.py tests/test_bad_input.py tests/test_faults.py tests/test_inproc_faults.py \
		tests/test_network.py tests/test_relay_faults.py

# The soak (tests/test_soak.py, also in the slow tier): a server with checkpoints and 4 workers
# train Deep MNIST for about 10 minutes while workers and the server are SIGKILLed and restarted
# and relays reset connections; checks fds, RSS, the push accounting and accuracy. The figures
# are printed and written to SOAK_FIGURES. SOAK_SECONDS=120: a short run of the same faults.
SOAK_FIGURES ?= runs/soak/figures.json
soak: $(VENV)/.stamp-test
	SOAK_FIGURES=$(SOAK_FIGURES) $(PY) -m pytest -q -ra -s -m soak tests/test_soak.py

# The MkDocs site (mkdocs.yml, docs/) into site/; --strict turns every warning (a broken link,
# a docstring that does not render) into a failure.
docs: $(VENV)/.stamp-docs
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

lint: $(VENV)/.stamp-test
	$(VENV)/bin/ruff check services shared tests
	$(VENV)/bin/ruff format --check services shared tests

# Side-by-side performance run; writes bench-results.json. QUICK=1: about 3 min, else about 25 min.
bench: $(VENV)/.stamp-test
	$(PY) tests/bench/bench.py $(if $(filter 1,$(QUICK)),--quick) --out bench-results.json

# What CURVE costs 1 worker end to end, ROUNDS rounds of plaintext / CURVE / CURVE + bf16
# (the full bench has three; the ratio moves from round to round): curve-cost.json, ~9 min.
ROUNDS ?= 6
bench-curve: $(VENV)/.stamp-test
	$(PY) tests/bench/curve_cost.py --rounds $(ROUNDS) --out curve-cost.json

# Convergence study of the staleness policies and gradient compression (docs/policies.md) on the MNIST CNN, the
# fixed-id and the hashed-id click models: study-results.json, study.md and PNG curves in OUT (runs/study).
# About 50 min on 2 cores (clicks: a few minutes, clicks-hashed: about 6); QUICK=1: 1 and 8 workers, no compression.
# ARGS='--models clicks --workers 1,2,4,8 --compressions none --kinds async,dc' narrows or widens a plan;
# ARGS='--models clicks --shards 2' simulates the server as 2 model shards, each its own queue.
# The fetch settings (n-fetch, bf16 pulls, adaptive): tests/bench/study_fetch.py (docs/policies.md).
OUT ?= runs/study
study: $(VENV)/.stamp-test
	$(PY) tests/bench/study.py $(if $(filter 1,$(QUICK)),--quick) --out $(OUT) $(ARGS)

clean:
	rm -rf $(VENV) runs build site *.egg-info .pytest_cache .ruff_cache
