# Two commands do all setup on a fresh machine (see README.md):
#   make demo   verl's own trainer on tiny models, as the canary (train, resume, merge): no Slurm, no GPU
#   make test   shellcheck + ruff + every test, then the reward tests on the oldest stack we support (what CI runs)
#   make test-fast  shellcheck + ruff + the unit tier only (no Slurm job, trainer or Ray): minutes, after every change
# Both create the virtual environment in .venv first if it is missing or older than requirements/; `make test` also
# starts the local Slurm 22.05 cluster the launch tests submit to (tests/slurm/local_slurm.sh; as root it installs
# Slurm with apt when it is missing). `make slurm` starts only that cluster.

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
# pytest-xdist processes (0: none), two in each tier: one a core. Four slow-tier processes were tried on the 2-core CI
# machine (2026-12-07): verl's trainer launches ran 3-4x slower (load 10-12) and `make demo`'s test hit its 900 s
# deadline. A short --basetemp per run keeps Ray's unix sockets under 107 bytes; --maxschedchunk 1 hands out one test
# at a time (tests/conftest.py orders them).
PYTEST_WORKERS ?= 2
SLOW_WORKERS ?= 2
XDIST = -n $(1) --maxschedchunk 1

# The repository's own shell files (git's list: not what an ignored folder holds), untracked new ones included.
shell_files = $(shell git ls-files --cached --others --exclude-standard -- '*.sh' '.ci/*' | sort)

.PHONY: help env lock trl demo test test-fast lint slurm clean-env

help:
	@sed -n '1,7p' Makefile

env: $(STAMP)

# torch first, the CPU build (else a dependency pulls a multi-GB CUDA one); requirements/lock.txt pins the rest (make
# lock). A failed install is tried once more: pip does not retry a truncated download.
$(STAMP): requirements/reward.txt requirements/reward-newest.txt requirements/test.txt requirements/constraints.txt requirements/lock.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@echo "make: 1/2 installing torch 2.13.0, the CPU build, into $(VENV) (a first install downloads ~200 MB)"
	$(BIN)/pip install --disable-pip-version-check torch==2.13.0
	@echo "make: 2/2 installing verl, megatron-core, transformers, ray and the test tools (requirements/test.txt): minutes"
	$(BIN)/pip install --disable-pip-version-check -r requirements/test.txt -c requirements/constraints.txt -c requirements/lock.txt \
	  || { echo "make: the install failed (above); trying once more"; \
	       $(BIN)/pip install --disable-pip-version-check -r requirements/test.txt -c requirements/constraints.txt -c requirements/lock.txt; }
	@echo "make: $(VENV) is ready"
	touch $@

# Re-resolve requirements/test.txt from scratch (a throwaway venv, pip's dry run) and write requirements/lock.txt.
lock:
	rm -rf $(VENV)-lock && $(PYTHON) -m venv $(VENV)-lock
	$(VENV)-lock/bin/pip install --disable-pip-version-check --quiet --dry-run --ignore-installed --report $(VENV)-lock/report.json \
	  torch==2.13.0 -r requirements/test.txt -c requirements/constraints.txt
	$(VENV)-lock/bin/python requirements/lock.py $(VENV)-lock/report.json > requirements/lock.txt
	rm -rf $(VENV)-lock

# The oldest reward stack we support (our base images', requirements/reward-oldest.txt): a few packages in a
# folder that goes first on PYTHONPATH, over the environment above.
OLDEST := $(VENV)/reward-oldest
$(OLDEST)/.installed: requirements/reward-oldest.txt $(STAMP)
	rm -rf $(OLDEST)
	$(BIN)/pip install --quiet --disable-pip-version-check --no-deps --target $(OLDEST) -r requirements/reward-oldest.txt
	touch $@

# The TRL versions whose RewardTrainer tests/test_trl_formats.py trains with, each in a folder of its own that the
# test puts first on PYTHONPATH in a subprocess (requirements/trl-*.txt); their dependencies are the environment's.
TRL_STACKS := $(VENV)/trl-0.23/.installed $(VENV)/trl-0.24/.installed $(VENV)/trl-newest/.installed
$(VENV)/trl-%/.installed: requirements/trl-%.txt $(STAMP)
	rm -rf $(VENV)/trl-$*
	$(BIN)/pip install --quiet --disable-pip-version-check --no-deps --target $(VENV)/trl-$* -r $<
	touch $@

trl: $(TRL_STACKS)

# The launch tests' Slurm; where it cannot start, `make test` goes on and those tests fail with the reason.
slurm:
	bash tests/slurm/local_slurm.sh start

demo: $(STAMP)
	$(BIN)/python -m demo.run

lint: $(STAMP)
	shellcheck --external-sources $(shell_files)
	ruff check .
	ruff format --check .

# The two tiers: tests/conftest.py marks `slow` what starts a Slurm job, a trainer or Ray; the unit tier is the rest.
# Between them they hold every test once (tests/test_docs.py checks it).
FAST_TIER := not slow
SLOW_TIER := slow
# pytest exits 5 when it collected nothing: the suite is never empty, so that is a failure like any other, unless
# PYTEST_ARGS picked a part that one tier has none of.
pytest_tier = $(BIN)/python -m pytest $(call XDIST,$(2)) --basetemp=$$(mktemp -d /tmp/pytest-XXXX) --durations=30 \
  -m "$(1)" $(PYTEST_ARGS) $(if $(PYTEST_ARGS),|| [[ $$? == 5 ]])

test-fast: lint
	$(call pytest_tier,$(FAST_TIER),$(PYTEST_WORKERS))

# The unit tier first (a broken change fails in minutes), then the slow one. The last run: the reward server and
# client tests, and verl's uvicorn pattern, on the oldest stack (transformers included).
OLDEST_TESTS := tests/test_reward_server.py tests/test_reward_client.py tests/test_reward_stack.py
test: lint $(OLDEST)/.installed $(TRL_STACKS)
	$(call pytest_tier,$(FAST_TIER),$(PYTEST_WORKERS))
	bash tests/slurm/local_slurm.sh start || echo "make test: the local Slurm cluster did not start (above): its tests will fail"
	$(call pytest_tier,$(SLOW_TIER),$(SLOW_WORKERS))
	REWARD_STACK=oldest PYTHONPATH=$(CURDIR)/$(OLDEST) $(BIN)/python -m pytest $(call XDIST,$(PYTEST_WORKERS)) --basetemp=$$(mktemp -d /tmp/pytest-XXXX) \
	  $(OLDEST_TESTS)

clean-env:
	rm -rf $(VENV)
