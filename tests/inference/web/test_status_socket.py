"""The live status websocket: anonymous and foreign-origin sockets are refused; a signed-in
member gets the status of the models they may use, staff of all."""

import pytest
from channels.auth import AuthMiddlewareStack
from channels.routing import URLRouter
from channels.security.websocket import AllowedHostsOriginValidator
from channels.testing import WebsocketCommunicator
from django.test import Client
from django.urls import path

from engine.protocol import EngineStats
from inference.web.consumers import StatusConsumer, status_payload
from tests.factories import ApiKeyFactory, StaffUserFactory, UserFactory

APP = AllowedHostsOriginValidator(
    AuthMiddlewareStack(URLRouter([path("ws/status/", StatusConsumer.as_asgi())]))
)


def session_cookie(user) -> bytes:
    client = Client()
    client.force_login(user)
    return f"sessionid={client.cookies['sessionid'].value}".encode()


def headers(cookie: bytes | None = None, origin: bytes = b"http://localhost"):
    out = [(b"origin", origin), (b"host", b"localhost")]
    if cookie:
        out.append((b"cookie", cookie))
    return out


@pytest.mark.django_db(transaction=True)
async def test_an_anonymous_socket_is_closed():
    socket = WebsocketCommunicator(APP, "/ws/status/", headers=headers())
    connected, code = await socket.connect()
    assert not connected and code == 4401


@pytest.mark.django_db(transaction=True)
async def test_a_foreign_origin_is_refused():
    from asgiref.sync import sync_to_async

    cookie = await sync_to_async(session_cookie)(await sync_to_async(StaffUserFactory)())
    socket = WebsocketCommunicator(
        APP, "/ws/status/", headers=headers(cookie, origin=b"http://evil.example")
    )
    connected, _ = await socket.connect()
    assert not connected


@pytest.mark.django_db(transaction=True)
async def test_a_signed_in_user_gets_status_updates():
    from asgiref.sync import sync_to_async

    cookie = await sync_to_async(session_cookie)(await sync_to_async(StaffUserFactory)())
    socket = WebsocketCommunicator(APP, "/ws/status/", headers=headers(cookie))
    connected, _ = await socket.connect()
    assert connected
    first = await socket.receive_json_from(timeout=5)
    second = await socket.receive_json_from(timeout=5)  # it keeps sending
    assert "models" in first and "models" in second
    assert "teams" in first  # staff see the teams' shares
    await socket.disconnect()


@pytest.mark.django_db
def test_staff_see_each_teams_share_of_an_engine():
    from inference.web.consumers import team_shares
    from tests.factories import TeamFactory

    team = TeamFactory(name="Research")
    tenant = f"team:{team.pk}"

    def stats(a: int, b: int) -> list[EngineStats]:
        tenants = {
            tenant: {"waiting": 3, "running": 4, "decode_tokens": a},
            "team:999999": {"waiting": 0, "running": 1, "decode_tokens": b},
        }
        return [EngineStats(model="m", tenants=tenants)]

    from inference.services.tenants import tenant_labels

    previous: dict = {}
    labels = tenant_labels([tenant, "team:999999"])
    assert labels == {tenant: "Research", "team:999999": "team:999999"}
    team_shares(stats(100, 50), previous, 1.0, labels)
    rows = team_shares(stats(130, 60), previous, 1.0, labels)
    research = next(r for r in rows if r["team"] == "Research")
    assert research["tokens_per_second"] == 30 and research["share"] == 0.75
    assert research["waiting"] == 3 and research["running"] == 4


def test_members_see_only_the_models_they_may_use():
    stats = [EngineStats(model="open", num_waiting=2, num_running=3), EngineStats(model="closed")]
    payload = status_payload(stats, {"open"})
    assert [m["model"] for m in payload["models"]] == ["open"]
    assert payload["models"][0]["waiting"] == 2 and payload["models"][0]["running"] == 3
    assert len(status_payload(stats, None)["models"]) == 2


@pytest.mark.django_db
def test_allowed_models_follow_the_users_keys(tiny_model_path):
    from inference.models import ModelEntry
    from inference.web.consumers import _allowed_models

    ModelEntry.objects.create(name="open", path=str(tiny_model_path))
    ModelEntry.objects.create(name="closed", path=str(tiny_model_path))
    member = UserFactory()
    key = ApiKeyFactory(user=member)
    key.all_models, key.allowed_models = False, ["open"]
    key.save()
    assert _allowed_models(member) == {"open"}
    assert _allowed_models(UserFactory()) == set()
    assert _allowed_models(StaffUserFactory()) is None
