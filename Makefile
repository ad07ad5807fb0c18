PYTHON ?= python3.11
VENV   ?= .venv
BIN    := $(VENV)/bin
POLICY ?= policies/example.yaml

.PHONY: demo test install dev bench clean

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

## Install what the tests need and run them.
test: dev
	$(BIN)/python -m pytest -q

## Run the benchmark scenarios that need no server and refresh their JSON.
bench: install
	$(BIN)/python benchmarks/run_all.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
