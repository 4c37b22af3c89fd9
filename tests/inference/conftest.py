"""Fixtures for the /v1 tests: keys, registered models and official OpenAI clients against the
live daphne server, and the scripted daphne."""

import time

import openai
import pytest
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


def refused_count(expected: int = 1) -> int:
    """The refusals the day's roll-ups count, once the server has written `expected` of them
    (it writes them within a second: inference/services/refusals.py)."""
    deadline = time.monotonic() + 5
    while True:
        count = DailyUsage.objects.aggregate(n=Sum("num_rejected"))["n"] or 0
        if count >= expected or time.monotonic() > deadline:
            return count
        time.sleep(0.05)
