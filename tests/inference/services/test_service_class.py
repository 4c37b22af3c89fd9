"""A request's service class without a server: the tier its `service_tier` and its key's tiers
resolve to on OpenAI's and Anthropic's routes, the 400s, and the team, weight and key the engine
shares by."""

import pytest

from accounts.models import ApiKey, Team
from engine import ServiceClass
from inference.api.serializers import (
    ANTHROPIC_SERVICE_TIERS,
    OPENAI_SERVICE_TIERS,
    ChatCompletionSerializer,
)
from inference.errors import APIError
from inference.services.service_class import service_class, service_tier_resolve

ALL = ["priority", "default", "flex"]
KEYS = {  # a key's tiers -> what a request that names none (OpenAI's auto) gets
    "all": (ALL, "default"),
    "default and flex": (["default", "flex"], "default"),
    "flex": (["flex"], "flex"),
    "priority and flex": (["priority", "flex"], "flex"),
    "priority": (["priority"], "priority"),
}


def resolve(tiers: dict, value: str, allowed: list[str]) -> str:
    return service_tier_resolve(allowed=allowed, accepted=tiers[value])


@pytest.mark.parametrize(("allowed", "auto"), KEYS.values(), ids=KEYS)
def test_openais_auto_is_default_else_flex_else_priority(allowed, auto):
    assert resolve(OPENAI_SERVICE_TIERS, "auto", allowed) == auto
    for tier in allowed:  # a tier the key may use is the tier served
        assert resolve(OPENAI_SERVICE_TIERS, tier, allowed) == tier


@pytest.mark.parametrize(("allowed", "auto"), KEYS.values(), ids=KEYS)
def test_anthropics_auto_is_priority_where_allowed_and_standard_only_is_openais_auto(allowed, auto):
    expected = "priority" if "priority" in allowed else auto
    assert resolve(ANTHROPIC_SERVICE_TIERS, "auto", allowed) == expected
    assert resolve(ANTHROPIC_SERVICE_TIERS, "standard_only", allowed) == auto


def test_a_tier_the_key_may_not_use_is_a_400_naming_the_ones_it_may():
    with pytest.raises(APIError) as caught:
        resolve(OPENAI_SERVICE_TIERS, "priority", ["default", "flex"])
    error = caught.value
    assert (error.status, error.param, error.type) == (400, "service_tier", "invalid_request_error")
    assert "'priority'" in error.message and "'default', 'flex'" in error.message


def body(**fields) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}


def test_the_field_reads_absent_and_null_as_auto_and_refuses_other_values():
    for sent in (body(), body(service_tier=None), body(service_tier="auto")):
        serializer = ChatCompletionSerializer(data=sent)
        assert serializer.is_valid(), serializer.errors
        assert serializer.validated_data["service_tier"] == OPENAI_SERVICE_TIERS["auto"]
    for value in ("scale", "fast", "standard_only", "", 1, ["flex"]):
        serializer = ChatCompletionSerializer(data=body(service_tier=value))
        assert not serializer.is_valid(), value
        assert "'auto', 'default', 'flex', 'priority'" in str(serializer.errors["service_tier"])


def test_the_service_class_is_the_keys_team_and_weight_the_key_and_the_tier():
    team = Team(pk=7, name="t", weight=3)
    api_key = ApiKey(pk=9, team=team, service_tiers=["priority", "default"])
    service = service_class(api_key=api_key, accepted=OPENAI_SERVICE_TIERS["auto"])
    assert service == ServiceClass(tenant="team:7", weight=3.0, principal="key:9", tier="default")
    priority = service_class(api_key=api_key, accepted=ANTHROPIC_SERVICE_TIERS["auto"])
    assert priority.tier == "priority" and priority.rank == 0
