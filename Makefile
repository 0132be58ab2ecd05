# fastpubsub — `make run` serves the API, `make test` runs every test.
# Both create .venv and install the project on first use: a fresh clone needs
# only Python 3.11+ and make.

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
EXTRAS ?= embedded,dev,spark

.DEFAULT_GOAL := help
.PHONY: help install run dev server test test-fast test-db test-matrix lint format typecheck migrate bench report archive clean

help: ## List the targets
	@awk 'BEGIN {FS = ":.*## "} /^[a-zA-Z_-]+:.*## / {printf "  \033[36m%-12s\033[0m %s\n", $$1, $$2}' $(MAKEFILE_LIST)

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ".[$(EXTRAS)]"
	@touch $(STAMP)

install: $(STAMP) ## Create .venv and install fastpubsub with its extras

run: $(STAMP) ## Serve the API on http://127.0.0.1:8000 (PORT=8080 for another; embedded PostgreSQL unless FASTPUBSUB_DATABASE_URL is set)
	$(BIN)/fastpubsub dev $(if $(PORT),--port $(PORT))

# Test processes (pytest-xdist workers, each with its own PostgreSQL); 0 runs in this one.
# Three on two cores: many tests wait (for a token to expire, a server to stop)
# while the others compute, and two left the cores a quarter idle.
TEST_WORKERS ?= 3
PARALLEL := $(if $(filter 0,$(TEST_WORKERS)),-p no:xdist,-n $(TEST_WORKERS) --dist loadgroup)

test: $(STAMP) ## Run the whole test suite against a real PostgreSQL (TEST_WORKERS=3 processes)
	$(BIN)/python -m pytest $(PARALLEL)

test-fast: $(STAMP) ## Run the tests without Spark, browser and slow end-to-end tests
	$(BIN)/python -m pytest $(PARALLEL) -m "not spark and not browser and not slow"

test-db: $(STAMP) ## The database-facing tests only: the SQL functions and the API on them
	$(BIN)/python -m pytest $(PARALLEL) -q -m "not spark and not browser and not slow" tests/db tests/api

PG_VERSIONS ?= 14 15 16 17 18
test-matrix: $(STAMP) ## The database-facing tests (test-db) on PostgreSQL 14-18 containers (needs a Docker engine)
	@for v in $(PG_VERSIONS); do \
		echo "== PostgreSQL $$v"; \
		FASTPUBSUB_TEST_POSTGRES_IMAGE=postgres:$$v $(MAKE) --no-print-directory test-db || exit 1; \
	done

lint: $(STAMP) ## ruff (lint and format check) and mypy
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

format: $(STAMP) ## Format the code with ruff
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

migrate: $(STAMP) ## Apply database migrations to FASTPUBSUB_DATABASE_URL
	$(BIN)/fastpubsub db-migrate

bench: $(STAMP) ## Run the benchmark suite (see benchmarks/README.md)
	$(BIN)/fastpubsub bench all

report: $(STAMP) ## Spark report over the last 24 hours into reports/
	$(BIN)/fastpubsub report --since 24h --out reports/

archive: $(STAMP) ## Archive acked history to FASTPUBSUB_ARCHIVE_URI (Spark)
	$(BIN)/fastpubsub archive

clean: ## Remove the virtualenv, caches and the embedded database
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .fastpubsub reports
