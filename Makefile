# The README's two commands: `make run` (set up and play the default scenario) and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test test-unit lint bench services-start services-stop clean

# The native decoder (fleetline/streams/_avrocols.c) is built by the install, so a change rebuilds it.
$(STAMP): pyproject.toml fleetline/streams/_avrocols.c
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

# Installs, starts Kafka and the S3 server, runs the simulated fleet, prints, stops them.
run: $(STAMP)
	$(VENV)/bin/fleetline run

# Starts (and afterwards stops) the services the tests need, from tests/conftest.py.
test: $(STAMP)
	$(PY) -m pytest

# Style, formatting, types (strict in processors/) and the layering contracts (pyproject.toml).
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

# The pure tests alone: no services, seconds.
test-unit: $(STAMP)
	$(PY) -m pytest tests/unit

bench: $(STAMP)
	$(PY) benchmarks/throughput.py
	$(PY) benchmarks/agents.py
	$(PY) benchmarks/view.py
	$(PY) benchmarks/audit.py
	$(PY) benchmarks/tiers.py
	$(PY) benchmarks/scheduler.py

services-start: $(STAMP)
	$(VENV)/bin/fleetline infra start

services-stop: $(STAMP)
	$(VENV)/bin/fleetline infra stop

clean:
	-$(VENV)/bin/fleetline infra wipe
	rm -rf $(VENV) .data
