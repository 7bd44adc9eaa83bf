# Stagewise: `make demo` runs the pipeline on the embedded default; `make test` runs the suite.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed
AIRFLOW_ENV := . scripts/airflow_env.sh
ONLY ?=
PYTEST_ARGS ?=
# pytest-xdist workers for `make test` (0: one process). The heavy tests spend part of their time waiting (on
# Airflow's scheduler, S3 retries, a task's sleep), so more workers than cores keep both busy; each more worker also
# costs collection and contention: on 2 cores 3 workers took 950 s (1,702 CPU-s), 4 took 1,020 s (1,898), 5 took
# 1,067 s and 2 were slower still.
# loadfile: a file's tests run on one worker and share its module fixtures (one pipeline run each), and the files on
# the shared live stack go together (tests/conftest.py's scheduler); they go out in collection order, which
# tests/conftest.py sorts longest first (--no-loadscope-reorder keeps it).
PYTEST_WORKERS ?= 3
# test-fast's tests wait on nothing, and each worker pays its own collection (torch, Airflow: ~12 CPU-s on a slow
# core): on 2 fast cores 2 workers took 59 s (93 CPU-s) and 3 took 57 s (101 CPU-s); on 2 cores half as fast, 2
# took 109 s (180 CPU-s) and 3 took 116 s (211 CPU-s).
FAST_WORKERS ?= 2
xdist = $(if $(filter 0,$(1)),,-n $(1) --dist loadfile --no-loadscope-reorder)
XDIST := $(call xdist,$(PYTEST_WORKERS))
# What `make test-fast` leaves out: every test that needs more than this Python process, and the slow ones (markers
# in pytest.ini). `make test` prints the 20 slowest tests.
FAST_MARKERS := not (airflow or torchrun or browser or service or gpu or subprocess or slow or slurm)

.PHONY: help venv mlflow-env airflow-init demo-data demo test test-fast test-ui bench up down clean

help:
	@echo "make demo   - run ml_pipeline end to end on the digits data (SQLite, LocalExecutor, local files)"
	@echo "make test   - lint (ruff check .), then run the whole test suite"
	@echo "make test-fast - lint, then every test that needs no Airflow, torchrun, browser, service, GPU or Slurm (a few minutes)"
	@echo "make test-ui - the browser suite (Debian chromium) and the official-client test; screenshots in tests/ui/artifacts/"
	@echo "make bench  - run the benchmarks (ONLY=a,b for a subset) into bench/results/latest.json"
	@echo "make up     - start a local Airflow (UI on 127.0.0.1:8080, scheduler, dag-processor); make down stops it"

venv: $(STAMP)

# The pinned set first, then this project itself, editable and without dependencies (pyproject.toml lists none):
# stagewise (tasks/, plugins/stagewise_airflow/, examples/) imports from the checkout in every process, with no PYTHONPATH.
$(STAMP): requirements.txt pyproject.toml
	@test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VENV)/bin/python -m pip install --quiet -r requirements.txt
	$(VENV)/bin/python -m pip install --quiet --no-deps -e .
	@# The build's metadata left in the checkout: with the checkout on a path (cwd, PYTHONPATH) it reads as a second
	@# installed stagewise, and Airflow would load the UI plugin's entry point twice.
	@rm -rf stagewise.egg-info
	@touch $(STAMP)

# MLflow's server and a serving environment, apart from Airflow's (their pins differ): the tracking tests and the
# mlflow_overhead benchmark start `mlflow server` from it; stagewise goes in without dependencies, for mlflow.pyfunc.
MLFLOW_VENV := .venv-mlflow
MLFLOW_STAMP := $(MLFLOW_VENV)/.installed
mlflow-env: $(MLFLOW_STAMP)
$(MLFLOW_STAMP): docker/mlflow/requirements.txt pyproject.toml
	@test -x $(MLFLOW_VENV)/bin/python || $(PYTHON) -m venv $(MLFLOW_VENV)
	$(MLFLOW_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(MLFLOW_VENV)/bin/python -m pip install --quiet -r docker/mlflow/requirements.txt
	$(MLFLOW_VENV)/bin/python -m pip install --quiet --no-deps -e .
	@rm -rf stagewise.egg-info
	@touch $(MLFLOW_STAMP)

airflow-init: $(STAMP)
	@$(AIRFLOW_ENV) && { airflow db migrate > "$$AIRFLOW_HOME/db-migrate.log" 2>&1 || { cat "$$AIRFLOW_HOME/db-migrate.log"; exit 1; }; } \
	  && python -m stagewise.airflow.pools

demo-data: $(STAMP)
	@$(AIRFLOW_ENV) && python -m stagewise.data demo

# The DAG of the pipeline in $$STAGEWISE_CONFIG (default pipeline.yaml, the pipeline `ml`): ml_pipeline. A test run
# goes into scratch unless its pipeline is opted in (docs/ci.md): the demo's storage is the laptop's own, and
# `stagewise.report latest` reads it there.
demo: airflow-init demo-data
	@$(AIRFLOW_ENV) && dag=$$(python -m stagewise.config --dag-id pipeline) && mkdir -p "$$AIRFLOW_HOME/logs" \
	  && export STAGEWISE_TEST_RUNS_WRITE="$${STAGEWISE_TEST_RUNS_WRITE:+$$STAGEWISE_TEST_RUNS_WRITE,}$${dag%_pipeline}" \
	  && echo "running: airflow dags test $$dag (log: .airflow/logs/demo.log)" \
	  && { airflow dags test "$$dag" > "$$AIRFLOW_HOME/logs/demo.log" 2>&1 \
	       || { tail -n 60 "$$AIRFLOW_HOME/logs/demo.log"; echo "demo failed: see .airflow/logs/demo.log"; exit 1; }; } \
	  && python -m stagewise.report latest

test: airflow-init mlflow-env
	@$(AIRFLOW_ENV) && python -m ruff check . && python -m pytest $(XDIST) --durations=20 $(PYTEST_ARGS)

# airflow-init: the in-process UI-plugin and DagBag tests read the repo-local Airflow DB (no server runs).
test-fast: airflow-init
	@$(AIRFLOW_ENV) && python -m ruff check . && python -m pytest $(call xdist,$(FAST_WORKERS)) -m "$(FAST_MARKERS)" $(PYTEST_ARGS)

test-ui: airflow-init
	@$(AIRFLOW_ENV) && python -m pytest tests/ui tests/dags/test_airflow_client.py $(PYTEST_ARGS)

# The engines some benchmarks compare against, pinned in bench/requirements.txt: installed for bench, never for test.
BENCH_STAMP := $(VENV)/.bench-installed
$(BENCH_STAMP): bench/requirements.txt $(STAMP)
	$(VENV)/bin/python -m pip install --quiet --no-deps -r bench/requirements.txt
	@touch $(BENCH_STAMP)

bench: airflow-init mlflow-env $(BENCH_STAMP)
	@$(AIRFLOW_ENV) && python -m bench $(if $(ONLY),--only $(ONLY))

# On a machine with CUDA and a plain python3 that has torch (not this venv): every CUDA test and GPU benchmark, one
# table, JSON results in $$GPU_CHECK_OUT (default bench/results); installs from .whl/, which gpu-wheels fills beforehand
# on a machine with the package index (scripts/gpu_check.sh says more; bench/README.md how to run it).
.PHONY: gpu-check gpu-wheels
gpu-check:
	@bash scripts/gpu_check.sh

gpu-wheels:
	@bash scripts/gpu_check.sh wheels

# Every pipeline of the checkout (pipeline.yaml and examples/) side by side, each with its demo data.
up: airflow-init
	@$(AIRFLOW_ENV) && python -m stagewise.data demo --all
	@bash scripts/airflow_up.sh

down:
	@bash scripts/airflow_down.sh

clean: down
	rm -rf .airflow .stagewise storage
