"""Orchard settings, read from the environment through config/env.py.

Defaults suit a developer machine: SQLite under $ORCHARD_HOME (default var/), the in-memory
channel layer, the engine in the web process. DATABASE_URL switches to PostgreSQL, REDIS_URL to
the Redis channel layer and shared rate limits. config/settings_production.py hardens this.
"""

import secrets

import dj_database_url
from django.core.exceptions import ImproperlyConfigured

from config.env import (
    BASE_DIR,
    env_bool,
    env_bytes,
    env_float,
    env_int,
    env_list,
    env_percent,
    env_share_or_bytes,
    env_str,
    ip_networks,
    orchard_home,
)

ORCHARD_HOME = orchard_home()
ORCHARD_HOME.mkdir(parents=True, exist_ok=True)


def _dev_secret_key() -> str:
    # A per-installation key kept under ORCHARD_HOME, so sessions survive restarts in development.
    path = ORCHARD_HOME / "secret_key"
    if not path.exists():
        path.write_text(secrets.token_urlsafe(50))
        path.chmod(0o600)
    return path.read_text().strip()


DEBUG = env_bool("DJANGO_DEBUG", False)
SECRET_KEY = env_str("DJANGO_SECRET_KEY") or _dev_secret_key()
ALLOWED_HOSTS = env_list("DJANGO_ALLOWED_HOSTS", ["127.0.0.1", "localhost", "[::1]", "testserver"])
CSRF_TRUSTED_ORIGINS = env_list("DJANGO_CSRF_TRUSTED_ORIGINS", [])

INSTALLED_APPS = [
    "daphne",
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "servestatic.runserver_nostatic",
    "django.contrib.staticfiles",
    "rest_framework",
    "channels",
    "accounts",
    "inference",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "servestatic.middleware.ServeStaticMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "inference.middleware.OpenAIApiMiddleware",
    "inference.web.csp.ContentSecurityPolicyMiddleware",
]
# The middleware of the /v1 routes a key authenticates (config/asgi.py): async only.
API_MIDDLEWARE = ["inference.middleware.OpenAIApiMiddleware"]

ROOT_URLCONF = "config.urls"
LOGIN_URL = "web-login"
LOGIN_REDIRECT_URL = "web-keys"
LOGOUT_REDIRECT_URL = "web-home"
ASGI_APPLICATION = "config.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
                "inference.web.context.navigation",
            ],
        },
    },
]

# Every SQLite database, however configured, gets these. IMMEDIATE takes the write lock at BEGIN,
# so concurrent writers queue on the busy timeout instead of failing with "database is locked"
# half-way through a transaction; WAL lets readers run beside the writer.
SQLITE_OPTIONS = {
    "transaction_mode": "IMMEDIATE",
    "timeout": 30,
    "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
}

DATABASE_URL = env_str("DATABASE_URL")
if DATABASE_URL:
    # CONN_MAX_AGE=0 for servers: connections are per thread; requests' threads are pooled
    # (common/request_threads.py), but a server's connections are a shared resource, so they
    # are opened per request. SQLite's are kept (below).
    DATABASES = {"default": dj_database_url.parse(DATABASE_URL, conn_max_age=0)}
else:
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": str(ORCHARD_HOME / "db.sqlite3"),
        }
    }
for _database in DATABASES.values():
    if _database["ENGINE"] == "django.db.backends.sqlite3":
        _database["OPTIONS"] = {**SQLITE_OPTIONS, **_database.get("OPTIONS", {})}
        # A file, not a server: each pooled request thread keeps its connection (opening one
        # and registering Django's SQL functions was a sixth of a small request's CPU).
        _database["CONN_MAX_AGE"] = 600
        # A file, not memory: the live-server tests share it with a daphne subprocess.
        _database.setdefault("TEST", {}).setdefault("NAME", str(ORCHARD_HOME / "test-db.sqlite3"))
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

REDIS_URL = env_str("REDIS_URL")
# Channel names, group names and Redis keys of the engine workers start with this, so several
# Orchard installations (or test runs) can share one Redis.
ORCHARD_WORKER_NAMESPACE = env_str("ORCHARD_WORKER_NAMESPACE", "orchard")
if REDIS_URL:
    CHANNEL_LAYERS = {
        "default": {
            "BACKEND": "channels_redis.core.RedisChannelLayer",
            "CONFIG": {
                # Receiving blocks in Redis for up to 5 s (channels-redis' BZPOPMIN), which is
                # also redis-py's default read timeout: give reads room past it.
                "hosts": [{"address": REDIS_URL, "socket_timeout": 15}],
                # A web process's reply channel holds batches of token events (one message per
                # engine step); a worker whose batches it does not read for this many messages
                # stops its requests. Workers' own channels take requests.
                "channel_capacity": {
                    f"{ORCHARD_WORKER_NAMESPACE}.reply*": 1000,
                    f"{ORCHARD_WORKER_NAMESPACE}.worker.*": 10000,
                },
            },
        }
    }
else:
    CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = ORCHARD_HOME / "static"

# Request bodies are capped in front of Django (inference/body_cap.py): a larger one is a 413
# before authentication and before anything reads it. /v1/embeddings has its own: 2048 inputs
# (OpenAI's most) of 512 token ids each are ~7 MiB of JSON, while a chat, Responses or Messages
# request filling a 128k-token context is ~1 MiB.
ORCHARD_MAX_BODY_BYTES = env_int("ORCHARD_MAX_BODY_BYTES", 4 * 1024 * 1024)
ORCHARD_MAX_EMBEDDINGS_BODY_BYTES = env_int("ORCHARD_MAX_EMBEDDINGS_BODY_BYTES", 8 * 1024 * 1024)
if min(ORCHARD_MAX_BODY_BYTES, ORCHARD_MAX_EMBEDDINGS_BODY_BYTES) < 1:
    raise ImproperlyConfigured(
        "ORCHARD_MAX_BODY_BYTES and ORCHARD_MAX_EMBEDDINGS_BODY_BYTES must be at least 1."
    )
# How fast one team's request bodies are read, per web process under daphne
# (inference/body_rate.py): a token bucket of ORCHARD_BODY_BURST_BYTES filling at
# ORCHARD_BODY_RATE_BYTES a second, per team once its key has authenticated in the process, else
# per client address. A team over it waits in TCP, not on the process every team shares. 0 turns
# it off. 16 MiB a second is sixteen prompts filling a 128k-token context a second, more than an
# engine takes in; a 200 MiB file uploads in ~12 s.
ORCHARD_BODY_RATE_BYTES = env_bytes("ORCHARD_BODY_RATE_BYTES", 16 << 20)
ORCHARD_BODY_BURST_BYTES = env_bytes("ORCHARD_BODY_BURST_BYTES", 16 << 20)
if ORCHARD_BODY_RATE_BYTES and ORCHARD_BODY_BURST_BYTES < 1:
    raise ImproperlyConfigured("ORCHARD_BODY_BURST_BYTES must be at least 1 byte.")
# Django's own check (form fields, request.body) never refuses a body the cap let through.
DATA_UPLOAD_MAX_MEMORY_SIZE = max(ORCHARD_MAX_BODY_BYTES, ORCHARD_MAX_EMBEDDINGS_BODY_BYTES)
# A body the API's caps let through stays in memory in Django's ASGI handler (a file part of an
# upload that small too): daphne hands it over only once it is whole, already in memory, and
# Django's 2.5 MB default wrote a 2.6 MB body to a temporary file and read it back on the event
# loop every team shares. Larger uploads (/v1/files) still go through temporary files. (While a
# body arrives, Twisted keeps one over 100 kB in a temporary file: kept in memory, a sender
# could hold that much memory per connection by stalling before its last bytes.)
FILE_UPLOAD_MAX_MEMORY_SIZE = DATA_UPLOAD_MAX_MEMORY_SIZE

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": ["rest_framework.authentication.SessionAuthentication"],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAdminUser"],
    "UNAUTHENTICATED_USER": None,
}

# Orchard
ORCHARD_MODELS_DIR = ORCHARD_HOME / "models"
# "local": the engine runs in the web process. "remote": `manage.py runengine` workers serve
# the models, reached over the Channels layer on Redis (REDIS_URL).
ORCHARD_ENGINE = env_str("ORCHARD_ENGINE", "local")
if ORCHARD_ENGINE not in ("local", "remote"):
    raise ImproperlyConfigured(
        f"ORCHARD_ENGINE must be 'local' or 'remote', not {ORCHARD_ENGINE!r}."
    )
if ORCHARD_ENGINE == "remote" and not REDIS_URL:
    raise ImproperlyConfigured(
        "ORCHARD_ENGINE=remote needs REDIS_URL (the workers' channel layer)."
    )
# Workers beat this often; one whose beat has not moved for the timeout is taken for dead.
ORCHARD_WORKER_HEARTBEAT_SECONDS = env_float("ORCHARD_WORKER_HEARTBEAT_SECONDS", 1.0, positive=True)
ORCHARD_WORKER_TIMEOUT_SECONDS = env_float("ORCHARD_WORKER_TIMEOUT_SECONDS", 5.0, positive=True)
# Workers read the registry this often (and at once when an admin changes a model).
ORCHARD_WORKER_SYNC_SECONDS = env_float("ORCHARD_WORKER_SYNC_SECONDS", 5.0, positive=True)
# How long a request waits for a model that a worker is still loading.
ORCHARD_MODEL_LOAD_WAIT_SECONDS = env_float("ORCHARD_MODEL_LOAD_WAIT_SECONDS", 600.0, positive=True)
# Load the enabled models when the web process starts, so the first request does not wait for
# them; models registered later load on their first request.
ORCHARD_PRELOAD_MODELS = env_bool("ORCHARD_PRELOAD_MODELS", True)
# One memory budget for every model a process serves (weights, KV caches and prefix caches): a
# share of the device's memory (Metal's recommended working set, or RAM on CPU) or a size. A
# model loads only where it fits, after unloading idle models that are not pinned (least
# recently used first); otherwise its requests get a 503 with Retry-After. Each chat model's
# caches get at most ORCHARD_MODEL_CACHE_SHARE of the budget (its "memory budget" field
# overrides), and a model not pinned unloads after ORCHARD_MODEL_IDLE_SECONDS without
# requests (its own setting overrides; 0: never).
ORCHARD_MEMORY_BUDGET_SHARE, ORCHARD_MEMORY_BUDGET_BYTES = env_share_or_bytes(
    "ORCHARD_MEMORY_BUDGET", 0.7
)
ORCHARD_MODEL_CACHE_SHARE = env_float("ORCHARD_MODEL_CACHE_SHARE", 0.5, positive=True)
if ORCHARD_MODEL_CACHE_SHARE > 1:
    raise ImproperlyConfigured("ORCHARD_MODEL_CACHE_SHARE must be at most 1.")
ORCHARD_MODEL_IDLE_SECONDS = env_float("ORCHARD_MODEL_IDLE_SECONDS", 1800.0)
if ORCHARD_MODEL_IDLE_SECONDS < 0:
    raise ImproperlyConfigured("ORCHARD_MODEL_IDLE_SECONDS must be 0 (never) or more.")
# The prefix cache's disk tier (engine/cache/disk/): what a chat model's prefix cache evicts from
# memory, and what it holds when the model unloads or the process stops, is kept in checked
# files under ORCHARD_PREFIX_DISK_DIR, at most ORCHARD_PREFIX_DISK_BYTES per model, and read
# back on a hit, also after a restart. 0: off.
ORCHARD_PREFIX_DISK_BYTES = env_bytes("ORCHARD_PREFIX_DISK_BYTES", 4 << 30)
ORCHARD_PREFIX_DISK_DIR = ORCHARD_HOME / "prefix-cache"
# Pulls from the Hugging Face hub (`manage.py pull`, the admin's "Pull a model"): the hub or a
# mirror (huggingface_hub reads HF_TOKEN and HF_HOME itself). Each web process runs the pulls
# made in the admin on a thread of its own, and resumes those a stopped process left.
HF_ENDPOINT = (env_str("HF_ENDPOINT") or "https://huggingface.co").rstrip("/")
ORCHARD_PULL_RUNNER = env_bool("ORCHARD_PULL_RUNNER", True)
# A chat template (or tokenizer) still rendering one prompt after this is stopped with a 400.
ORCHARD_RENDER_TIMEOUT_SECONDS = env_float("ORCHARD_RENDER_TIMEOUT_SECONDS", 10.0, positive=True)
# A request's preparation before admission (reading its body, checking its grammar, rendering,
# tokenizing) runs on this many threads and tokenizer processes per web process, shared fairly:
# a team runs at most ORCHARD_PREPARE_PER_TEAM jobs at once and queues at most
# ORCHARD_PREPARE_QUEUE_PER_TEAM more (then 429), and a free worker goes to the teams in turn.
ORCHARD_PREPARE_WORKERS = env_int("ORCHARD_PREPARE_WORKERS", 4)
ORCHARD_PREPARE_PER_TEAM = env_int("ORCHARD_PREPARE_PER_TEAM", 2)
ORCHARD_PREPARE_QUEUE_PER_TEAM = env_int("ORCHARD_PREPARE_QUEUE_PER_TEAM", 256)
if min(ORCHARD_PREPARE_WORKERS, ORCHARD_PREPARE_PER_TEAM) < 1 or ORCHARD_PREPARE_QUEUE_PER_TEAM < 0:
    raise ImproperlyConfigured(
        "ORCHARD_PREPARE_WORKERS and ORCHARD_PREPARE_PER_TEAM must be at least 1, "
        "ORCHARD_PREPARE_QUEUE_PER_TEAM at least 0."
    )
# Each web process (and `runengine` worker) renders and tokenizes in ORCHARD_PREPARE_WORKERS
# tokenizer processes of each kind (engine/text/processes.py); each keeps the last
# ORCHARD_TOKENIZERS_PER_PROCESS tokenizers it used (~80 MB each for Qwen3's, on a process of
# ~250 MB), and one that has had no job for ORCHARD_TOKENIZER_IDLE_SECONDS stops (the last stays).
ORCHARD_TOKENIZERS_PER_PROCESS = env_int("ORCHARD_TOKENIZERS_PER_PROCESS", 4)
ORCHARD_TOKENIZER_IDLE_SECONDS = env_float("ORCHARD_TOKENIZER_IDLE_SECONDS", 300.0, positive=True)
if ORCHARD_TOKENIZERS_PER_PROCESS < 1:
    raise ImproperlyConfigured("ORCHARD_TOKENIZERS_PER_PROCESS must be at least 1.")
# A /v1 body of this many bytes or more is first read and checked in a preflight process
# (inference/api/preflight.py): one the checks refuse (a schema past the grammar limit, say)
# never holds the web process's interpreter, which every request of every team needs. 0: off.
ORCHARD_PREFLIGHT_BYTES = env_int("ORCHARD_PREFLIGHT_BYTES", 256 * 1024)
# A preflight check past this much CPU time (six times as long in all, 5 s at least, on a
# machine too busy to give it any) lets the body through to the web process's own read.
ORCHARD_PREFLIGHT_TIMEOUT_SECONDS = env_float(
    "ORCHARD_PREFLIGHT_TIMEOUT_SECONDS", 0.5, positive=True
)
# The engine's fair share between teams and service tiers (engine/core/fairness.py): off, the
# engines admit in arrival order and never preempt. A tier below the top keeps at least this
# share of a batch's rows while it has work, however busy the higher tiers are.
ORCHARD_FAIR_SHARE = env_bool("ORCHARD_FAIR_SHARE", True)
ORCHARD_TIER_MIN_SHARE = env_float("ORCHARD_TIER_MIN_SHARE", 0.1)
if not 0 <= ORCHARD_TIER_MIN_SHARE < 1:
    raise ImproperlyConfigured("ORCHARD_TIER_MIN_SHARE must be at least 0 and below 1.")
# While a higher tier has requests, the flex tier (/v1/batches) keeps this share of a batch's
# rows (engine/core/fairness.py `Yielding`): fewer rows make shorter steps, so interactive
# streams decode faster beside a batch, and the batch gets less done (bench/RESULTS.md, "Batches
# beside interactive traffic"). 1: no yielding, the batch takes every row it can.
ORCHARD_FLEX_YIELD_SHARE = env_float("ORCHARD_FLEX_YIELD_SHARE", 0.25)
if not 0 < ORCHARD_FLEX_YIELD_SHARE <= 1:
    raise ImproperlyConfigured("ORCHARD_FLEX_YIELD_SHARE must be above 0 and at most 1.")
# A structured-output grammar (from a JSON schema, a regex, Lark, or a forced tool call) larger
# than this is refused with a 400 before it is compiled.
ORCHARD_GRAMMAR_MAX_BYTES = env_int("ORCHARD_GRAMMAR_MAX_BYTES", 512 * 1024)
if ORCHARD_GRAMMAR_MAX_BYTES < 1:
    raise ImproperlyConfigured("ORCHARD_GRAMMAR_MAX_BYTES must be at least 1.")
# Image inputs (inference/images/): at most ORCHARD_IMAGE_MAX_BYTES and ORCHARD_IMAGE_MAX_PIXELS
# each (the pixels read from the header, before anything is decoded). Image URLs are fetched only
# when ORCHARD_IMAGE_FETCH is on (data URLs always work), then only from public addresses and the
# networks of ORCHARD_IMAGE_FETCH_ALLOWED_NETWORKS, within the timeout (the whole fetch) and
# following at most ORCHARD_IMAGE_FETCH_MAX_REDIRECTS redirects.
ORCHARD_IMAGE_FETCH = env_bool("ORCHARD_IMAGE_FETCH", False)
ORCHARD_IMAGE_FETCH_ALLOWED_NETWORKS = ip_networks(
    "ORCHARD_IMAGE_FETCH_ALLOWED_NETWORKS", env_list("ORCHARD_IMAGE_FETCH_ALLOWED_NETWORKS", [])
)
ORCHARD_IMAGE_FETCH_MAX_REDIRECTS = env_int("ORCHARD_IMAGE_FETCH_MAX_REDIRECTS", 3)
ORCHARD_IMAGE_FETCH_TIMEOUT_SECONDS = env_float(
    "ORCHARD_IMAGE_FETCH_TIMEOUT_SECONDS", 10.0, positive=True
)
ORCHARD_IMAGE_MAX_BYTES = env_bytes("ORCHARD_IMAGE_MAX_BYTES", 20 << 20)
ORCHARD_IMAGE_MAX_PIXELS = env_int("ORCHARD_IMAGE_MAX_PIXELS", 40_000_000)
# A request's images together (each is decoded, resized and encoded while the request runs).
ORCHARD_IMAGE_MAX_REQUEST_PIXELS = env_int("ORCHARD_IMAGE_MAX_REQUEST_PIXELS", 80_000_000)
if (
    ORCHARD_IMAGE_FETCH_MAX_REDIRECTS < 0
    or min(ORCHARD_IMAGE_MAX_BYTES, ORCHARD_IMAGE_MAX_PIXELS, ORCHARD_IMAGE_MAX_REQUEST_PIXELS) < 1
):
    raise ImproperlyConfigured(
        "ORCHARD_IMAGE_FETCH_MAX_REDIRECTS must be 0 or more, ORCHARD_IMAGE_MAX_BYTES, "
        "ORCHARD_IMAGE_MAX_PIXELS and ORCHARD_IMAGE_MAX_REQUEST_PIXELS at least 1."
    )
# The reverse proxies in front of the web processes (addresses or CIDR networks). A request from
# one of them has its client address read from X-Forwarded-For, right to left, past these; empty:
# the client is REMOTE_ADDR (accounts/signin.py, the sign-in throttle).
ORCHARD_TRUSTED_PROXIES = ip_networks(
    "ORCHARD_TRUSTED_PROXIES", env_list("ORCHARD_TRUSTED_PROXIES", [])
)
# `GET /metrics` also accepts `Authorization: Bearer <this>` (else only staff API keys).
ORCHARD_METRICS_TOKEN = env_str("ORCHARD_METRICS_TOKEN", "")
# `manage.py purge_responses` deletes stored /v1/responses responses older than this by default.
ORCHARD_RESPONSES_RETENTION_DAYS = env_int("ORCHARD_RESPONSES_RETENTION_DAYS", 30)
# The bytes of stored /v1/responses responses a team may keep (a team's own quota, set in the
# admin, overrides it): a request with `store` that would exceed it is refused before it runs.
ORCHARD_RESPONSE_STORAGE_BYTES_PER_TEAM = env_int(
    "ORCHARD_RESPONSE_STORAGE_BYTES_PER_TEAM", 256 * 1024 * 1024
)
if ORCHARD_RESPONSE_STORAGE_BYTES_PER_TEAM < 0:
    raise ImproperlyConfigured("ORCHARD_RESPONSE_STORAGE_BYTES_PER_TEAM must be 0 or more.")

# Files and batches (/v1/files, /v1/batches: inference/batches/). Uploads and batch output files
# are kept under ORCHARD_FILES_DIR; a file may be at most ORCHARD_FILE_MAX_BYTES, a team's files
# together at most ORCHARD_FILE_STORAGE_BYTES_PER_TEAM (output files included), and a batch at
# most ORCHARD_BATCH_MAX_LINES requests. A batch's lines run in the flex tier, at most
# ORCHARD_BATCH_CONCURRENCY at once per batch (0: the model's max_num_seqs).
ORCHARD_FILES_DIR = ORCHARD_HOME / "files"
ORCHARD_FILE_MAX_BYTES = env_bytes("ORCHARD_FILE_MAX_BYTES", 200 << 20)
ORCHARD_FILE_STORAGE_BYTES_PER_TEAM = env_bytes("ORCHARD_FILE_STORAGE_BYTES_PER_TEAM", 2 << 30)
ORCHARD_BATCH_MAX_LINES = env_int("ORCHARD_BATCH_MAX_LINES", 50_000)
ORCHARD_BATCH_CONCURRENCY = env_int("ORCHARD_BATCH_CONCURRENCY", 0)
# Each web process runs batches on a thread of its own (and resumes those a stopped process left).
ORCHARD_BATCH_RUNNER = env_bool("ORCHARD_BATCH_RUNNER", True)
if ORCHARD_BATCH_MAX_LINES < 1 or ORCHARD_BATCH_CONCURRENCY < 0:
    raise ImproperlyConfigured(
        "ORCHARD_BATCH_MAX_LINES must be at least 1 and ORCHARD_BATCH_CONCURRENCY 0 or more."
    )

# Spend (accounts/limits/budgets.py, accounts/alerts/, inference/services/prices.py): the one
# currency prices, costs and money budgets are in (ISO 4217), and the budget alerts.
ORCHARD_CURRENCY = (env_str("ORCHARD_CURRENCY", "USD") or "").upper()
if not (len(ORCHARD_CURRENCY) == 3 and ORCHARD_CURRENCY.isalpha() and ORCHARD_CURRENCY.isascii()):
    raise ImproperlyConfigured("ORCHARD_CURRENCY must be an ISO 4217 code such as USD or EUR.")
# A budget without thresholds of its own (and a key's monthly token budget) alerts at these
# percentages, once each per period.
ORCHARD_BUDGET_ALERT_THRESHOLDS = sorted(
    {
        env_percent("ORCHARD_BUDGET_ALERT_THRESHOLDS", value)
        for value in env_list("ORCHARD_BUDGET_ALERT_THRESHOLDS", ["50", "80", "100"])
    }
)
# Who gets a budget alert by email: "owners" (the team's owners), "member" (a key budget's key
# holder, a member budget's member), and any addresses, comma-separated.
ORCHARD_BUDGET_ALERT_EMAILS = env_list("ORCHARD_BUDGET_ALERT_EMAILS", ["owners", "member"])
if any(e not in ("owners", "member") and "@" not in e for e in ORCHARD_BUDGET_ALERT_EMAILS):
    raise ImproperlyConfigured(
        'ORCHARD_BUDGET_ALERT_EMAILS takes "owners", "member" and email addresses, comma-separated.'
    )
# Alert webhooks: an attempt waits this long for an answer; a failed one is retried after
# ORCHARD_WEBHOOK_RETRY_SECONDS, doubling each time, until ORCHARD_WEBHOOK_MAX_ATTEMPTS.
ORCHARD_WEBHOOK_TIMEOUT_SECONDS = env_float("ORCHARD_WEBHOOK_TIMEOUT_SECONDS", 10.0, positive=True)
ORCHARD_WEBHOOK_RETRY_SECONDS = env_float("ORCHARD_WEBHOOK_RETRY_SECONDS", 30.0, positive=True)
ORCHARD_WEBHOOK_MAX_ATTEMPTS = env_int("ORCHARD_WEBHOOK_MAX_ATTEMPTS", 6)
if ORCHARD_WEBHOOK_MAX_ATTEMPTS < 1:
    raise ImproperlyConfigured("ORCHARD_WEBHOOK_MAX_ATTEMPTS must be at least 1.")
# Email (budget alerts): SMTP when DJANGO_EMAIL_HOST is set, else written to the server's log.
DJANGO_EMAIL_HOST = env_str("DJANGO_EMAIL_HOST")
if DJANGO_EMAIL_HOST:
    EMAIL_BACKEND = "django.core.mail.backends.smtp.EmailBackend"
    EMAIL_HOST = DJANGO_EMAIL_HOST
    EMAIL_PORT = env_int("DJANGO_EMAIL_PORT", 587)
    EMAIL_HOST_USER = env_str("DJANGO_EMAIL_HOST_USER", "")
    EMAIL_HOST_PASSWORD = env_str("DJANGO_EMAIL_HOST_PASSWORD", "")
    EMAIL_USE_TLS = env_bool("DJANGO_EMAIL_USE_TLS", True)
else:
    EMAIL_BACKEND = "django.core.mail.backends.console.EmailBackend"
EMAIL_TIMEOUT = 10
DEFAULT_FROM_EMAIL = env_str("DJANGO_DEFAULT_FROM_EMAIL", "orchard@localhost")

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": env_str("ORCHARD_LOG_LEVEL", "INFO")},
    "loggers": {"django.db.backends": {"level": "WARNING"}},
}
