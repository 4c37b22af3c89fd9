"""create_api_key and revoke_api_key: the raw key only on stdout, once; revocation by prefix or
key makes the next request fail."""

from io import StringIO

import pytest
from django.core.management import CommandError, call_command

from accounts import keys
from accounts.authentication import ERROR_REVOKED, AuthenticationError, authenticate_header
from accounts.management.commands.revoke_api_key import Command as RevokeApiKey
from accounts.models import ApiKey, Membership
from tests.factories import api_key_with_raw

pytestmark = pytest.mark.django_db


def _create(*args: str) -> tuple[str, str]:
    out, err = StringIO(), StringIO()
    call_command("create_api_key", *args, stdout=out, stderr=err)
    return out.getvalue().strip(), err.getvalue()


def test_create_prints_the_raw_key_on_stdout_only():
    raw, err = _create(
        "--user",
        "alice",
        "--rpm",
        "10",
        "--tpm",
        "100",
        "--max-parallel",
        "2",
        "--budget-tokens",
        "1000",
        "--max-output-tokens",
        "64",
        "--expires-days",
        "3",
        "--name",
        "ci",
    )
    assert keys.is_well_formed(raw)
    assert raw not in err
    api_key = ApiKey.objects.get()
    assert api_key.prefix in err
    assert (api_key.rpm, api_key.tpm, api_key.max_parallel, api_key.budget_tokens) == (
        10,
        100,
        2,
        1000,
    )
    assert api_key.max_output_tokens == 64
    assert api_key.expires_at is not None and api_key.name == "ci"
    assert api_key.team.name == "alice"
    assert Membership.objects.get().role == Membership.Role.OWNER
    assert authenticate_header(f"Bearer {raw}") == api_key


def test_create_with_models_and_team():
    _create("--user", "bob", "--team", "research", "--models", "a, b")
    api_key = ApiKey.objects.get()
    assert (api_key.team.name, api_key.all_models, api_key.allowed_models) == (
        "research",
        False,
        ["a", "b"],
    )


def test_create_refuses_bad_limits():
    with pytest.raises(CommandError):
        _create("--user", "carol", "--rpm", "0")
    with pytest.raises(CommandError):
        _create("--user", "carol", "--models", ",")
    for tiers in ("scale", ","):
        with pytest.raises(CommandError, match="--service-tiers"):
            _create("--user", "carol", "--service-tiers", tiers)
    assert not ApiKey.objects.exists()


def test_create_with_service_tiers():
    _create("--user", "dana")
    _create("--user", "dana", "--service-tiers", "flex, priority")
    assert [k.service_tiers for k in ApiKey.objects.order_by("pk")] == [
        ["default", "flex"],
        ["priority", "flex"],
    ]


@pytest.mark.parametrize("form", ["prefix", "prefix…", "raw"])
def test_revoke_by_prefix_or_key(form):
    api_key, raw = api_key_with_raw()
    given = {"prefix": api_key.prefix, "prefix…": f"{api_key.prefix}…", "raw": raw}[form]
    out = StringIO()
    call_command("revoke_api_key", given, stdout=out)
    assert api_key.prefix in out.getvalue() and raw not in out.getvalue()
    with pytest.raises(AuthenticationError) as caught:
        authenticate_header(f"Bearer {raw}")
    assert caught.value.message == ERROR_REVOKED


def test_revoke_unknown_key():
    with pytest.raises(CommandError):
        call_command("revoke_api_key", "sk-orch-nothere")


def test_revoke_help_steers_to_the_prefix():
    parser = RevokeApiKey().create_parser("manage.py", "revoke_api_key")
    text = " ".join(parser.format_help().split())
    assert "displayed prefix" in text and "shell history" in text
