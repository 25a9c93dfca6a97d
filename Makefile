# The README's two commands: `make run` (set up and play the default scenario) and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

# Every tool a target installs is named here, before any rule uses it: make expands a rule's
# prerequisites as it reads the rule, so a variable defined below it is empty there (how `run`
# once lost Open MPI). `fleetline doctor` lists the same tools; `make lint` checks each target
# below still has the ones fleetline/infra/needs.py says it needs (tools/check_make_needs.py).
.PHONY: run test test-unit chaos lint bench bench-peers services-build services-start \
	services-stop clean mpi slurm chromium kubernetes
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
APT_INSTALL := $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq
# The browser tests drive Debian's Chromium (Playwright's own browser download is not used).
CHROMIUM := /usr/bin/chromium
# The Slurm backend's tests run a real Slurm (controller, node daemons, munge) from Debian's
# packages; `fleetline infra start --slurm` configures and starts it.
SLURMCTLD := /usr/sbin/slurmctld
# A training job's workers talk through Open MPI (Debian's; mpi4py from PyPI loads it): the
# process backend starts them under `mpirun`, Slurm under `srun --mpi=pmix` (whose plugin loads
# libpmix.so, which only libpmix-dev provides).
MPIRUN := /usr/bin/mpirun
# The AsyncAPI CLI that validates contract/asyncapi.yaml (npm, pinned by package-lock.json).
CONTRACT_TOOLS := contract/node_modules/.installed
# The OpenID provider the sign-in tests start (node-oidc-provider, pinned by its lock file).
IDP_TOOLS := fleetline/infra/oidc_provider/node_modules/.installed

# The tools by name, as `fleetline doctor` names their install commands.
mpi: $(MPIRUN)
slurm: $(SLURMCTLD)
chromium: $(CHROMIUM)
# The Kubernetes control plane, built once from its Go modules into ~/.cache/fleetline (about
# 20 minutes on two cores the first time; seconds when it is there).
kubernetes: $(STAMP)
	$(VENV)/bin/fleetline infra build kubernetes
# The broker's jars (Maven) and the S3 server (Go), once, into .cache/: `make test` builds them
# before the suite so that their minutes are reported apart from the tests'.
services-build: $(STAMP)
	$(VENV)/bin/fleetline infra build kafka s3

# The native decoder (fleetline/streams/_avrocols.c) is built by the install, so a change rebuilds it.
$(STAMP): pyproject.toml fleetline/streams/_avrocols.c
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

# Installs, starts Kafka and the S3 server, runs the simulated fleet, prints, stops them.
run: $(STAMP) mpi
	$(VENV)/bin/fleetline run

$(CHROMIUM):
	$(SUDO) apt-get update -qq
	$(APT_INSTALL) chromium

$(SLURMCTLD):
	$(SUDO) apt-get update -qq
	$(APT_INSTALL) slurmctld slurmd slurm-client munge

$(MPIRUN):
	$(SUDO) apt-get update -qq
	$(APT_INSTALL) openmpi-bin libpmix-dev

$(CONTRACT_TOOLS): contract/package.json contract/package-lock.json
	cd contract && npm ci --no-audit --no-fund --loglevel=error
	touch $@

$(IDP_TOOLS): fleetline/infra/oidc_provider/package.json fleetline/infra/oidc_provider/package-lock.json
	cd fleetline/infra/oidc_provider && npm ci --no-audit --no-fund --loglevel=error
	touch $@

# The one-time installs and builds are its prerequisites, each reporting its own time; then it
# starts (and afterwards stops) the services the tests need, from tests/conftest.py; the
# browser tests start Chromium headless; the contract test builds the Go consumer; the Slurm
# tests start a Slurm cluster of their own; the sign-in tests an OpenID provider. A test
# process that dies of a fatal signal leaves a core; its crashing thread's native stack is
# printed last (tools/crash_backtrace.py).
test: $(STAMP) mpi slurm kubernetes chromium services-build $(IDP_TOOLS)
	@mkdir -p .cache && touch .cache/test-started
	ulimit -c unlimited 2>/dev/null; $(PY) -m pytest; status=$$?; \
	if [ $$status -gt 128 ]; then $(PY) tools/crash_backtrace.py .cache/test-started; fi; \
	exit $$status

# Style, formatting, types (strict in processors/), the layering contracts (pyproject.toml),
# that each target below installs the tools it plays (fleetline/infra/needs.py), and the topics'
# AsyncAPI document: current with the code, and valid.
lint: $(STAMP) $(CONTRACT_TOOLS)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports
	$(PY) tools/check_pure_cores.py
	$(PY) tools/check_make_needs.py
	$(PY) tools/analyst_functions.py --check
	$(VENV)/bin/fleetline contract asyncapi --check
	$(VENV)/bin/fleetline contract records --check
	cd contract && SUPPRESS_NO_CONFIG_WARNING=1 npx --no-install asyncapi validate asyncapi.yaml --fail-severity=warn

# The fault-injection suite in full: more rounds of each fault, and the long runs (`make test`
# runs one round of each).
chaos: $(STAMP) mpi
	FLEETLINE_CHAOS=full $(PY) -m pytest tests/chaos

# The pure tests alone: no services, seconds.
test-unit: $(STAMP)
	$(PY) -m pytest tests/unit

bench: $(STAMP) mpi slurm kubernetes
	$(PY) benchmarks/throughput.py
	$(PY) benchmarks/agents.py
	$(PY) benchmarks/view.py
	$(PY) benchmarks/audit.py
	$(PY) benchmarks/tiers.py
	$(PY) benchmarks/scheduler.py
	$(PY) benchmarks/cluster_control.py
	$(PY) benchmarks/console.py
	$(PY) benchmarks/observability.py
	$(PY) benchmarks/operations.py
	$(PY) benchmarks/serving.py
	$(PY) benchmarks/replay.py
	$(PY) benchmarks/sharded.py
	$(PY) benchmarks/dataplane.py
	$(PY) benchmarks/heterogeneous.py
	$(PY) benchmarks/ettr.py
	$(PY) benchmarks/peers.py
	$(PY) benchmarks/readme_table.py

# fleetline's scheduler beside Slurm's controller and the Kubernetes scheduler, on one fleet and
# one job stream (benchmarks/peers.py): Slurm from Debian's packages, Kubernetes built once into
# the user's cache on its first run (minutes). The README's performance table is then made again
# from the last three runs.
bench-peers: $(STAMP) slurm kubernetes
	$(PY) benchmarks/peers.py
	$(PY) benchmarks/readme_table.py

services-start: $(STAMP)
	$(VENV)/bin/fleetline infra start

services-stop: $(STAMP)
	$(VENV)/bin/fleetline infra stop

clean:
	-$(VENV)/bin/fleetline infra wipe
	rm -rf $(VENV) .data contract/node_modules fleetline/infra/oidc_provider/node_modules
