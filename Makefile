# `make test`: the whole test suite on a fresh machine.  `make bench`: the main job.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
VENV_LATEST ?= .venv-latest
BIN := $(VENV)/bin
export PIP_DISABLE_PIP_VERSION_CHECK := 1
# pip byte-compiles every module it installs (torch's thousands, most never imported): install without that, and let
# Python cache the modules the tests import, on first import (which PYTHONDONTWRITEBYTECODE, set on some machines, stops).
PIP_INSTALL = -m pip install -q --no-compile
unexport PYTHONDONTWRITEBYTECODE

.PHONY: test install sync pytest nbtest test-latest bench export clean

# The newest-fastai environment builds in the background while the first pass runs (pip waits mostly on the network and
# the disk, the tests on the cores); its tests run once both are done. Its build log: .venv-latest.log. The build runs in a
# process group of its own, stopped whole when `make test` is interrupted (a background job would not see Ctrl-C).
test: sync
	@setsid $(MAKE) --no-print-directory $(VENV_LATEST)/.installed > $(VENV_LATEST).log 2>&1 & build=$$!; \
	trap 'kill -TERM -- -$$build 2>/dev/null; wait $$build; exit 130' INT TERM; \
	$(MAKE) --no-print-directory pytest nbtest; rc=$$?; \
	if ! wait $$build; then echo "building $(VENV_LATEST) failed:"; tail -n 30 $(VENV_LATEST).log; exit 1; fi; \
	exit $$rc
	$(MAKE) --no-print-directory test-latest

# Create the development environment when missing; reinstall when the metadata changes.
$(BIN)/.installed: setup.py settings.ini
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python $(PIP_INSTALL) -e '.[dev,distributed]'
	touch $@

install: $(BIN)/.installed

# The notebooks are the source: exporting them must leave the committed modules unchanged.
sync: install
	@rm -rf .sync_check && mkdir .sync_check && cp -r loss_filters .sync_check/
	$(BIN)/nbdev_export
	@if diff -r -x __pycache__ .sync_check/loss_filters loss_filters; then rm -rf .sync_check; \
	else rm -rf .sync_check; echo "nbdev_export changed loss_filters/: notebooks and modules are out of sync"; exit 1; fi
	$(BIN)/python tools/readme.py --check

# The tests in parallel: one worker per core, a test file at a time on one worker (a file's tests share fixtures), one
# compute thread per worker (torch's threads spin-waiting for each other on shared cores cost more than they bring); the 15
# slowest tests named at the end, to keep `make test` short.
PYTEST_WORKERS ?= auto
ONE_THREAD := OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
PYTEST = $(ONE_THREAD) $(1)/python -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile -p no:cacheprovider --durations=15 tests

pytest: install
	$(call PYTEST,$(BIN))

# Two notebooks at a time, one compute thread each, for the same reason as the tests.
nbtest: install
	LF_SMOKE=1 $(ONE_THREAD) $(BIN)/nbdev_test --n_workers 2

# The library does not pin fastai: run the pytest suite against the newest release too. Both environments get the same torch
# release; its ~5 GB (CUDA libraries included) are hard-linked from the first one (tools/share_torch.py), not installed twice.
$(VENV_LATEST)/.installed: setup.py settings.ini
	test -x $(VENV_LATEST)/bin/python || $(PYTHON) -m venv $(VENV_LATEST)
	-test -x $(BIN)/python && $(BIN)/python tools/share_torch.py $(BIN)/python $(VENV_LATEST)/bin/python
	$(VENV_LATEST)/bin/python $(PIP_INSTALL) -U -e '.[distributed,grad]' fastai pytest pytest-xdist hypothesis scikit-learn matplotlib cockpit-for-pytorch backpack-for-pytorch 'setuptools<81'
	touch $@

# Tests marked `fastai_neutral` (statistics, selection rules in plain torch) test nothing of fastai's behaviour, and those marked
# `tooling` (the benchmark's command line, the README's examples, the executors, tools/) make only fastai calls the others make too:
# the first pass ran them.
test-latest: $(VENV_LATEST)/.installed
	$(VENV_LATEST)/bin/python -c "import fastai, fastcore, torch; print('latest env: fastai', fastai.__version__, 'fastcore', fastcore.__version__, 'torch', torch.__version__)"
	$(call PYTEST,$(VENV_LATEST)/bin) -m 'not fastai_neutral and not tooling'

# The main job: a first reading of the Batch Loss Filter with every control, 5 seeds, fits on every core, on Fashion-MNIST
# (scikit-learn's digits when it is absent).
BENCH_ARGS ?=
bench: install
	-@test -d /usr/share/datasets/fashion-mnist || { command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ] && \
	  apt-get install -y -qq dataset-fashion-mnist >/dev/null 2>&1; } || true
	$(BIN)/lf_bench --jobs $$(nproc) $(BENCH_ARGS)

export: install
	$(BIN)/nbdev_export && $(BIN)/nbdev_clean && $(BIN)/python tools/readme.py

clean:
	rm -rf $(VENV) $(VENV_LATEST) build dist *.egg-info .pytest_cache
