# Stagewise: `make demo` runs the pipeline on the embedded default; `make test` runs the suite.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed
AIRFLOW_ENV := . scripts/airflow_env.sh
ONLY ?=
PYTEST_ARGS ?=

.PHONY: help venv airflow-init demo-data demo test test-ui bench up down clean

help:
	@echo "make demo   - run ml_pipeline end to end on the digits data (SQLite, LocalExecutor, local files)"
	@echo "make test   - lint (ruff check .), then run the whole test suite"
	@echo "make test-ui - the browser suite (Debian chromium) and the official-client test; screenshots in tests/ui/artifacts/"
	@echo "make bench  - run the benchmarks (ONLY=a,b for a subset) into bench/results/latest.json"
	@echo "make up     - start a local Airflow (UI on 127.0.0.1:8080, scheduler, dag-processor); make down stops it"

venv: $(STAMP)

# The pinned set first, then this project itself, editable and without dependencies (pyproject.toml lists none):
# tasks, stagewise_airflow and examples import from the checkout in every process, with no PYTHONPATH.
$(STAMP): requirements.txt pyproject.toml
	@test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VENV)/bin/python -m pip install --quiet -r requirements.txt
	$(VENV)/bin/python -m pip install --quiet --no-deps -e .
	@touch $(STAMP)

airflow-init: $(STAMP)
	@$(AIRFLOW_ENV) && { airflow db migrate > "$$AIRFLOW_HOME/db-migrate.log" 2>&1 || { cat "$$AIRFLOW_HOME/db-migrate.log"; exit 1; }; } \
	  && python -m stagewise_airflow.pools

demo-data: $(STAMP)
	@$(AIRFLOW_ENV) && python -m tasks.data demo

demo: airflow-init demo-data
	@$(AIRFLOW_ENV) && mkdir -p "$$AIRFLOW_HOME/logs" && echo "running: airflow dags test ml_pipeline (log: .airflow/logs/demo.log)" \
	  && { airflow dags test ml_pipeline > "$$AIRFLOW_HOME/logs/demo.log" 2>&1 \
	       || { tail -n 60 "$$AIRFLOW_HOME/logs/demo.log"; echo "demo failed: see .airflow/logs/demo.log"; exit 1; }; } \
	  && python -m tasks.report latest

test: airflow-init
	@$(AIRFLOW_ENV) && python -m ruff check . && python -m pytest $(PYTEST_ARGS)

test-ui: airflow-init
	@$(AIRFLOW_ENV) && python -m pytest tests/ui tests/dags/test_airflow_client.py $(PYTEST_ARGS)

# The engines some benchmarks compare against, pinned in bench/requirements.txt: installed for bench, never for test.
BENCH_STAMP := $(VENV)/.bench-installed
$(BENCH_STAMP): bench/requirements.txt $(STAMP)
	$(VENV)/bin/python -m pip install --quiet --no-deps -r bench/requirements.txt
	@touch $(BENCH_STAMP)

bench: airflow-init $(BENCH_STAMP)
	@$(AIRFLOW_ENV) && python -m bench $(if $(ONLY),--only $(ONLY))

up: airflow-init demo-data
	@bash scripts/airflow_up.sh

down:
	@bash scripts/airflow_down.sh

clean: down
	rm -rf .airflow .stagewise storage
