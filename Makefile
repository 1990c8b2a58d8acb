# capflow: every target creates/updates .venv itself (idempotent; fast when nothing changed).
SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.capflow-installed
CONSTRAINTS := infra/constraints.txt
PYTEST_ARGS ?=
export PIP_DISABLE_PIP_VERSION_CHECK := 1
export MPLCONFIGDIR := $(CURDIR)/.cache/matplotlib
export MLFLOW_DISABLE_TELEMETRY := true
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export DO_NOT_TRACK := 1
export PREFECT_HOME ?= $(CURDIR)/.capflow/prefect
# Prefect's temporary server (capflow run, the tests) gets 90 s to start, not 20 s: enough on a loaded machine
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS ?= 90

.PHONY: install browser stack-up stack-down test test-fast test-gpu lint format demo lock clean help

help:
	@echo "make demo     - install (if needed) and run the whole pipeline on a synthetic dataset (capflow run --preset demo)"
	@echo "make test     - install (if needed) and run the whole test suite"
	@echo "make stack-up - local Prefect + MLflow + S3 servers (capflow stack up); make stack-down stops them"
	@echo "make test-gpu - the CUDA tests only (on a machine with a GPU)"
	@echo "make lint     - ruff"
	@echo "make install  - create/update .venv (CAPFLOW_SKIP_DETECTRON2=1: bring your own detectron2)"

install: $(STAMP)

$(STAMP): pyproject.toml $(CONSTRAINTS) infra/install_detectron2.py
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q -c $(CONSTRAINTS) "setuptools<81" wheel
	$(BIN)/python -m pip install -q -c $(CONSTRAINTS) --no-build-isolation -e ".[dev]"
	$(BIN)/python infra/install_detectron2.py --python $(BIN)/python
	@touch $(STAMP)
	@echo "environment ready: $(VENV)"

# Headless Chromium for the UI test (tests/flows/test_stack.py): installed with apt-get when missing and running as
# root (CI); elsewhere install it yourself or the browser test is skipped. CAPFLOW_NO_APT=1 never installs.
browser:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || \
	  if [ "$$(id -u)" = 0 ] && [ -z "$$CAPFLOW_NO_APT" ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing chromium (apt-get)"; \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null 2>&1 || \
	    { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null; }; \
	  else echo "chromium not found: the UI screenshot test will be skipped"; fi

test: install browser
	$(BIN)/python -m pytest $(PYTEST_ARGS)

test-fast: install
	$(BIN)/python -m pytest -m "not slow" $(PYTEST_ARGS)

# CUDA tests only (fast paths equal the reference paths, reduced-precision agreement, CUDA kill-and-resume).
# They skip with a reason where no CUDA device is present; CI has none.
test-gpu: install
	$(BIN)/python -m pytest -m gpu -rs $(PYTEST_ARGS)

lint: install
	$(BIN)/ruff check .

format: install
	$(BIN)/ruff format .

# The local servers (capflow stack): Prefect :4200, MLflow :5000, S3 endpoint :9000 on 127.0.0.1.
stack-up: install
	$(BIN)/capflow stack up

stack-down: install
	$(BIN)/capflow stack down

demo: install
	@mkdir -p "$(PREFECT_HOME)"
	$(BIN)/capflow run --preset demo

# Re-resolve the pinned stack from pyproject.toml's ranges into infra/constraints.txt.
lock:
	rm -rf .lock-venv && $(PYTHON) -m venv .lock-venv
	.lock-venv/bin/pip install -q "setuptools<81" wheel
	.lock-venv/bin/pip install -q -e ".[dev]"
	{ echo "# Pinned stack known to install and run together (Python 3.11, Linux x86_64). Regenerate with 'make lock'."; \
	  echo "# torch/torchvision use arbitrary equality (===) so pip takes the registry's standard wheels, not a local +cpu build."; \
	  .lock-venv/bin/pip freeze --all --exclude-editable | grep -v -E "^(pip|capflow)[=@ ]" \
	  | sed -e 's/^torch==/torch===/' -e 's/^torchvision==/torchvision===/'; } > $(CONSTRAINTS)
	rm -rf .lock-venv

clean:
	rm -rf $(VENV) .cache .pytest_cache .ruff_cache
