# Two commands do all setup on a fresh machine (see README.md):
#   make demo   the main job on its embedded default: tiny models, no Slurm, no GPU
#   make test   shellcheck + ruff + every test (what CI runs, through .ci/run)
# Both create the virtual environment in .venv first if it is missing or older than requirements/.

SHELL := bash
.SHELLFLAGS := -euo pipefail -c
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV ?= .venv
BIN := $(CURDIR)/$(VENV)/bin
STAMP := $(VENV)/.installed
export PATH := $(BIN):$(PATH)
# Extra pytest arguments, e.g. make test PYTEST_ARGS="-k reward -x"
PYTEST_ARGS ?=

shell_files = $(shell find . -path ./$(VENV) -prune -o -type f \( -name '*.sh' -o -path './.ci/*' \) -print | sort)

.PHONY: help env demo test lint clean-env

help:
	@sed -n '1,4p' Makefile

env: $(STAMP)

# torch first, from the local CPU build: anything that pulls torch before it would download a multi-GB CUDA build.
$(STAMP): requirements/reward.txt requirements/test.txt requirements/constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check torch==2.13.0
	$(BIN)/pip install --quiet --disable-pip-version-check -r requirements/test.txt -c requirements/constraints.txt
	touch $@

demo: $(STAMP)
	$(BIN)/python -m demo.run

lint: $(STAMP)
	shellcheck --external-sources $(shell_files)
	ruff check .
	ruff format --check .

# pytest exits 5 when it collected nothing: the suite is never empty, so that is a failure like any other.
test: lint
	$(BIN)/python -m pytest $(PYTEST_ARGS)

clean-env:
	rm -rf $(VENV)
