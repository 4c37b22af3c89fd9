"""Fixtures for the /v1 tests: keys, registered models and official OpenAI clients against the
live daphne server, and the scripted daphne."""

import time

import openai
import pytest
from django.contrib.auth import get_user_model
from django.db.models import Sum

from accounts.services import api_key_create, team_membership_ensure, user_get_or_create
from inference.models import DailyUsage
from inference.services.registry import model_register
from tests.fixtures.daphne import stop_daphne
from tests.inference.api.responses.scripted import start_scripted

TINY = "tiny-chat"
TINY_SIMPLE = "tiny-chat-simple"


@pytest.fixture
def make_key(transactional_db):
    def make(username: str = "alice", team: str = "team-a", **limits) -> str:
        user = user_get_or_create(username=username)
        team_obj, _ = team_membership_ensure(user=user, team_name=team)
        _, raw = api_key_create(user=user, team=team_obj, **limits)
        return raw

    return make


@pytest.fixture
def tiny_models(transactional_db, tiny_model_path):
    """The tiny model registered twice: batched (default) and on the simple engine."""
    model_register(name=TINY, path=tiny_model_path, engine="batched", make_default=True)
    model_register(name=TINY_SIMPLE, path=tiny_model_path, engine="simple")
    return TINY, TINY_SIMPLE


@pytest.fixture
def api_key(make_key, tiny_models) -> str:
    return make_key()


@pytest.fixture
def staff_key(make_key, tiny_models) -> str:
    """A key of a staff user (who may scrape /metrics)."""
    key = make_key("ops", "ops-team")
    get_user_model().objects.filter(username="ops").update(is_staff=True)
    return key


@pytest.fixture
def client(live_server_url, api_key) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live_server_url}/v1", api_key=api_key, max_retries=0)


@pytest.fixture
def async_client(live_server_url, api_key) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{live_server_url}/v1", api_key=api_key, max_retries=0)


@pytest.fixture(scope="session")
def scripted_url(django_db_setup, tmp_path_factory):
    """The scripted daphne (tests/fixtures/scripted_daphne.py) playing every script of
    tests/inference/api/responses/scripted.py, started once per test process and shared by the
    files that need forced replies; like the live server, it shares the test database."""
    process, url = start_scripted(tmp_path_factory.mktemp("scripted"))
    yield url
    stop_daphne(process)


def alerts_settled(expected: int = 0, timeout: float = 10) -> int:
    """The budget alerts written, once the server's alert thread has written at least `expected`
    and gone quiet (it starts half a second after a request spends a budget: accounts/alerts/
    worker.py). A test that spends a budget over a live server ends with this: the thread's
    writes must not meet the flush that empties the tables after the test (on PostgreSQL a
    TRUNCATE that deadlocks with them; on SQLite rows left for the next test)."""
    from django.db import connection

    from accounts.spend import BudgetAlert

    deadline = time.monotonic() + timeout
    time.sleep(0.6)
    counts = []
    while time.monotonic() < deadline:
        counts.append(BudgetAlert.objects.count())
        busy = 0
        if connection.vendor == "postgresql":
            with connection.cursor() as cursor:
                cursor.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                    "AND pid <> pg_backend_pid() AND state <> 'idle'"
                )
                busy = cursor.fetchone()[0]
        if counts[-1] >= expected and not busy and counts[-5:] == [counts[-1]] * 5:
            break
        time.sleep(0.05)
    return counts[-1]


def key_alerts_written(used: int, limit: int) -> int:
    """The alerts of a key budget of `limit` tokens with `used` spent (alerts_settled)."""
    from django.conf import settings

    reached = sum(1 for t in settings.ORCHARD_BUDGET_ALERT_THRESHOLDS if used * 100 >= t * limit)
    return alerts_settled(reached)


def refused_count(expected: int = 1) -> int:
    """The refusals the day's roll-ups count, once the server has written `expected` of them
    (it writes them within a second: inference/services/refusals.py)."""
    deadline = time.monotonic() + 5
    while True:
        count = DailyUsage.objects.aggregate(n=Sum("num_rejected"))["n"] or 0
        if count >= expected or time.monotonic() > deadline:
            return count
        time.sleep(0.05)


@pytest.fixture(scope="module")
def image_server():
    """A local image server for a module's image fetches (tests/inference/images/server.py)."""
    from tests.inference.images.server import ImageServer

    server = ImageServer()
    yield server
    server.close()
