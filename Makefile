PYTHON ?= python3.11
VENV   ?= .venv
BIN    := $(VENV)/bin
POLICY ?= policies/example.yaml

.PHONY: demo test install dev bench clean redis-server

# Root installs system packages itself; anyone else through sudo.
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

$(BIN)/python:
	$(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

install: $(BIN)/python
	$(BIN)/pip install --quiet -e .

dev: $(BIN)/python
	$(BIN)/pip install --quiet -e '.[dev]'

## Start the gateway on the embedded simulated GPU with the example policy.
demo: install
	$(BIN)/qosgate demo --config $(POLICY)

## The quota tests start a real redis-server; install Debian's when missing.
redis-server:
	@command -v redis-server >/dev/null 2>&1 || { \
	  echo "installing redis-server (apt-get)"; \
	  $(SUDO) apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq redis-server >/dev/null; \
	} || { echo "could not install redis-server: install it, then run make test again"; exit 1; }

## Install what the tests need and run them.
test: dev redis-server
	$(BIN)/python -m pytest -q

## Run the benchmark scenarios that need no server and refresh their JSON.
bench: install
	$(BIN)/python benchmarks/run_all.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
