# lmqtt: one command to run the gateway, one to run the tests. Every target is idempotent:
# the virtual environment is created once and re-installed only when pyproject.toml changes.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   ?= .venv
PY     := $(VENV)/bin/python
CORE   := $(VENV)/.installed-core
DEV    := $(VENV)/.installed-dev

.PHONY: run test lint unit test-tools bench clean

$(PY):
	$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "lmqtt needs Python 3.11+"'
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

# setup.py builds the optional C accelerators: a changed .c file re-installs (re-compiles) it,
# and so does a changed module of the mypyc group (accelerators/compiled.py lists them; until
# it is built again, the group runs as Python).
COMPILED := $(shell $(PYTHON) -c 'import accelerators.compiled as c; print(*c.sources())' 2>/dev/null)
SPEEDUPS := setup.py accelerators/kernel.h gateway/protocol/_speedups.c gateway/delivery/_run.c gateway/messages/_batch.c store/_speedups.c \
	rocketmq_remoting/_speedups.c gateway/storage/_fsync.c accelerators/compiled.py $(COMPILED)

$(CORE): pyproject.toml $(SPEEDUPS) | $(PY)
	$(PY) -m pip install --quiet -e .
	touch $@

$(DEV): pyproject.toml $(SPEEDUPS) | $(PY)
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(CORE) $@

## run: install what the gateway needs and start it on ./lmqtt-data, port 1883 (or a free one)
run: $(CORE)
	$(VENV)/bin/lmqtt serve

## test: install everything, lint, then run the whole test suite
test: $(DEV)
	$(MAKE) --no-print-directory lint
	$(MAKE) --no-print-directory unit

lint: $(DEV)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

# One pytest-xdist worker per core (auto). --dist loadgroup keeps the tests sharing an expensive
# fixture (the RocketMQ cluster, the Spark session) on one worker: see tests/conftest.py.
# Bytecode goes to the venv, written once even where PYTHONDONTWRITEBYTECODE is set: otherwise
# every process of the run (each worker, each gateway or CLI the tests start) compiles the
# project's modules from source again.
WORKERS ?= auto
unit: $(DEV) test-tools
	PYTHONDONTWRITEBYTECODE= PYTHONPYCACHEPREFIX=$(abspath $(VENV))/pycache \
	$(PY) -m pytest -q -p no:cacheprovider -n $(WORKERS) --dist loadgroup --durations=40

# The Debian programs end-to-end tests run, installed when missing (best effort: without root or
# network the tests that need them skip, and fail under .ci/run's LMQTT_REQUIRE_ROCKETMQ=1 and
# LMQTT_REQUIRE_NETNS=1).
# haproxy: tests/rocketmq/test_balancer_failover.py runs the compose balancer's configuration.
# tmux: tests/gateway/ops/test_live_view.py runs `lmqtt top` in a terminal and reads it back.
# iproute2 (`ip`, in Debian's default install): tests/partition's network namespaces.
test-tools:
	command -v haproxy >/dev/null || test -x /usr/sbin/haproxy || (apt-get update -qq && apt-get install -y -qq haproxy) || true
	command -v tmux >/dev/null || (apt-get update -qq && apt-get install -y -qq tmux) || true
	command -v ip >/dev/null || test -x /usr/sbin/ip || test -x /sbin/ip || (apt-get update -qq && apt-get install -y -qq iproute2) || true

## bench: compare lmqtt with amqtt and Mosquitto (installs mosquitto from Debian if missing)
bench: $(DEV)
	command -v mosquitto >/dev/null || (apt-get update -qq && apt-get install -y -qq mosquitto) || true
	$(PY) -m bench

clean:
	rm -rf $(VENV) build gateway/*/*.so store/*.so lmqtt-data bench/results reports .pytest_cache .mypy_cache .ruff_cache
