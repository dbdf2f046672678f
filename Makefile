# Quick start: `make run` (the whole pipeline on the tiny default) and `make test`.
# Both create .venv from requirements.lock on first use (Python 3.11).
SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
STAMP := $(VENV)/.installed
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)
# Offline runs and the tests read raw data from a mirror (docs/data.md; `make mirror DIR=...` builds one).
# Unset, the variable names a sibling mirror folder of this checkout if you keep one there.
export PIPELINE_DATA_MIRROR ?= $(if $(wildcard ../shared/data),$(abspath ../shared/data))
# The CPU build of torch where there is no NVIDIA GPU (the default wheel bundles CUDA, several GB).
TORCH_INDEX := $(if $(shell command -v nvidia-smi),,--extra-index-url https://download.pytorch.org/whl/cpu)
MLFLOW_PORT ?= 5000

.PHONY: run lint test test-system venv mirror dag bench mlflow-ui html-report plots exp-show push pull lock clean

# .venv is made by Python 3.11 only: the version requirements.lock was resolved for.
NOT_PYTHON_311 = make: .venv needs Python 3.11; $(if $(PYTHON),PYTHON=$(PYTHON) is \
  $$($(PYTHON) --version 2>&1 | head -n 1),there is no python3.11 or python3 on PATH): install it \
  (apt-get install python3.11-venv) or name one: make PYTHON=/path/to/python3.11 $(MAKECMDGOALS)

# Packages installed without byte-code, then compiled by compileall on every core (pip compiles one file
# after another: half of the install on 2 cores). torch ships one test helper in Python 3.12 syntax, which
# pip's own compile passes over as well. pipelines/gc-threshold.pth: the garbage collector's thresholds of
# every Python in .venv (that file says why).
# The lock is installed with hashes required: every file pip fetches must have a sha256 the lock records
# (pip would check them anyway, the lock having hashes; --require-hashes also refuses a lock without them).
# torch, installed the line before (the CPU build here has no hash in the lock), satisfies the lock's pin,
# so pip keeps it and checks nothing of it (pipelines/lock.py).
$(STAMP): requirements.lock pyproject.toml pipelines/gc-threshold.pth
	@test -x $(VENV)/bin/python || [[ "$$($(PYTHON) --version 2>&1)" == "Python 3.11."* ]] || \
	  { echo "$(NOT_PYTHON_311)" >&2; exit 1; }
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --upgrade pip==24.3.1
	$(VENV)/bin/pip install --quiet --no-compile --retries 1 torch==2.13.0 $(TORCH_INDEX)
	$(VENV)/bin/pip install --quiet --no-compile --require-hashes -r requirements.lock
	$(VENV)/bin/pip install --quiet --no-deps --no-build-isolation -e .
	purelib="$$($(VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" && \
	  $(VENV)/bin/python -m compileall -qq -j 0 -x 'torch/testing/_internal/py312_intrinsics\.py' "$$purelib" && \
	  cp pipelines/gc-threshold.pth "$$purelib/"
	touch $@

# A page template for `dvc plots show --html-template` with the Vega libraries inlined: plots render offline.
PLOTS_TEMPLATE := .dvc/plots/offline.html
$(PLOTS_TEMPLATE): $(STAMP) pipelines/plots.py
	python -m pipelines.plots

venv: $(STAMP) $(PLOTS_TEMPLATE)

# Then where the time went, per stage (pipelines/timebudget.py; the same table in docs/pipeline.md).
run: $(STAMP)
	@started=$$(date +%s.%N); code=0; \
	  snakemake --profile pipelines/profiles/local --cores all || code=$$?; \
	  python -m pipelines.timebudget --since $$started --docs docs/pipeline.md || true; exit $$code

# Tests run in pytest-xdist workers, each module's tests in one worker, the longest modules first
# (tests/conftest.py): much of a test's time is process start-up and waits that leave a core idle, so make
# test runs more workers than a 2-core machine has cores (TEST_WORKERS: 3 took 16 min of pytest where 2 took 20,
# when the suite was longer).
# make test-system runs SYSTEM_TEST_WORKERS (3) as well: its tests wait on SLURM, heartbeats, image builds
# and the network as much as they compute (the time limits they check leave minutes of room). 0: one process.
TEST_WORKERS ?= 3
SYSTEM_TEST_WORKERS ?= 3
# PYTEST_ARGS: more pytest options (.ci/run adds a JUnit report).
PYTEST := python -m pytest -q --dist loadfile --no-loadscope-reorder --durations=25 $(PYTEST_ARGS)

lint: $(STAMP)
	ruff check .
	ruff format --check .
	lint-imports

# Lint and format check first (seconds), then the tests. The tests that read a whole ci pipeline run share
# one, made by the first that asks and kept for this tree in .cache/ci-run/ (tests/shared_run.py).
test: lint
	$(PYTEST) -n $(TEST_WORKERS) -m "not long" tests --ignore=tests/system

# As root: a two-node SLURM cluster (in network namespaces) running the pipeline, the stage
# containers built with podman, the MLflow UI in headless Chromium (tests/system/), with the tests marked
# long (minutes each). Installs the Debian packages they need first; each test that cannot run here is
# skipped with the reason.
test-system: $(STAMP)
	bash tests/system/install.sh
	$(PYTEST) -n $(SYSTEM_TEST_WORKERS) -m "system or long" tests

# A data mirror in DIR from the pinned public sources, each file checked against its sha256 (pipelines/mirror.py);
# resumes a cut download and keeps the files already there. Then: PIPELINE_DATA_MIRROR=DIR make test.
mirror: $(STAMP)
	@test -n "$(DIR)" || { echo "make mirror: name the folder to fill, e.g. make mirror DIR=$$HOME/pipeline-data" >&2; exit 2; }
	python -m pipelines.mirror "$(DIR)"

dag: $(STAMP)
	python -m pipelines.dag write

bench: $(STAMP)
	python bench/tokenize_throughput.py
	python bench/pretrain_throughput.py --compile
	python bench/eval_throughput.py
	python bench/gnn_epoch.py
	python bench/qlora_memory.py
	python bench/checkpoint_stall.py
	python bench/parallel_study.py   # on data/tokenize: after make run

# The MLflow UI on 127.0.0.1 only, over the embedded store that stages write (mlflow.db, mlartifacts/);
# first the pages to open (the runs table in the saved view `training`, the registered models). Without
# the server's job runners (eight more processes, 2 GB, for MLflow's GenAI jobs, which the pipeline does not use).
mlflow-ui: $(STAMP)
	-@python -m pipelines.ui $(MLFLOW_PORT) sqlite:///$(CURDIR)/mlflow.db
	MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false mlflow server --backend-store-uri sqlite:///$(CURDIR)/mlflow.db --host 127.0.0.1 --port $(MLFLOW_PORT) --workers 1

# One self-contained HTML page of the last run: results table, stage metrics, plots (report.html).
html-report: $(STAMP)
	python -m pipelines.html_report --output report.html

# `dvc exp show` with the metrics only: params and dependency hashes dropped (they are each a column).
# KEEP='<regex>' keeps the params or dependencies it matches, e.g. KEEP='pretrain\.train\.lr$$'.
# (the params sections: stages.common.config.STAGE_SECTIONS, read when the target runs)
STAGE_SECTIONS = $(shell python -c "from stages.common.config import STAGE_SECTIONS as s; print('|'.join(s))")
exp-show: $(STAMP)
	dvc exp show --no-pager --drop '($(STAGE_SECTIONS))\.|(stages|pipelines|containers)/|data/[^:]*$$' $(if $(KEEP),--keep '$(KEEP)')

# DVC's plots of the last run, offline: dvc_plots/index.html (plain `dvc plots show` loads Vega from a CDN).
plots: $(PLOTS_TEMPLATE)
	dvc plots show --html-template $(PLOTS_TEMPLATE)

# The results to the DVC remote, so that other machines pull them and `dvc repro --pull` restores any stage
# run here from the run cache: dvc push, dvc push --run-cache, and the files those leave behind
# (pipelines/share.py).
push: $(STAMP)
	python -m pipelines.share push

# Elsewhere: dvc pull, then every out hashed from its bytes against dvc.lock; a damaged object of DVC's
# cache is fetched again (pipelines/share.py).
pull: $(STAMP)
	python -m pipelines.share pull

# Re-resolve requirements.in and pin the result (torch stays at the version the Makefile installs), each pin
# with the sha256 of every file PyPI serves for its version (uv, in pipelines/lock.py; a few seconds).
lock: $(STAMP)
	$(VENV)/bin/pip install --quiet -r requirements.in
	$(VENV)/bin/python -m pipelines.lock
	$(VENV)/bin/python -m pipelines.lock --tool pipelines/tools/crate-check.in  # the RO-Crate validator's own
	$(VENV)/bin/python -m pipelines.dag write  # the families' package lists follow the lock

clean:
	rm -rf .cache data/*/ reports/* logs .snakemake checkpoints mlflow.db mlflow.db.lock mlartifacts report.html snakemake-report.html
