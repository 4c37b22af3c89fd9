"""factory-boy factories for the gateway's models. Keys are made through the real service so the
prefix and digest are real; `api_key_with_raw` also returns the raw key for Bearer requests."""

import factory
from django.contrib.auth import get_user_model
from django.utils import timezone

from accounts.models import ApiKey, Membership, Team
from accounts.services import api_key_create
from inference.models import ModelEntry, UsageRecord


class UserFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = get_user_model()
        django_get_or_create = ("username",)

    username = factory.Sequence(lambda n: f"user{n}")
    email = factory.LazyAttribute(lambda u: f"{u.username}@example.com")


class StaffUserFactory(UserFactory):
    is_staff = True
    is_superuser = True
    password = factory.django.Password("admin-pass-123")


class TeamFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Team
        django_get_or_create = ("name",)

    name = factory.Sequence(lambda n: f"team{n}")


class MembershipFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Membership

    team = factory.SubFactory(TeamFactory)
    user = factory.SubFactory(UserFactory)
    role = Membership.Role.MEMBER


class ApiKeyFactory(factory.django.DjangoModelFactory):
    """An ApiKey made by `api_key_create`, its user a member of its team. Pass `models=[...]` to
    restrict it; the raw key is dropped (use `api_key_with_raw` when you need it)."""

    class Meta:
        model = ApiKey

    team = factory.SubFactory(TeamFactory)
    user = factory.SubFactory(UserFactory)
    name = factory.Sequence(lambda n: f"key{n}")

    @classmethod
    def _create(cls, model_class, *args, **kwargs):
        Membership.objects.get_or_create(team=kwargs["team"], user=kwargs["user"])
        api_key, _ = api_key_create(**kwargs)
        return api_key


def api_key_with_raw(**kwargs) -> tuple[ApiKey, str]:
    """A key and its raw value, made by the real service; kwargs as for `api_key_create` (team and
    user default to new ones, with the user a member of the team)."""
    team = kwargs.pop("team", None) or TeamFactory()
    user = kwargs.pop("user", None) or UserFactory()
    Membership.objects.get_or_create(team=team, user=user)
    return api_key_create(team=team, user=user, **kwargs)


class ModelEntryFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = ModelEntry
        django_get_or_create = ("name",)

    name = factory.Sequence(lambda n: f"model-{n}")
    path = factory.LazyAttribute(lambda m: f"/models/{m.name}")


class UsageRecordFactory(factory.django.DjangoModelFactory):
    """An in-progress usage row (finish it with `usage_finish`)."""

    class Meta:
        model = UsageRecord

    request_id = factory.Sequence(lambda n: f"req-{n}")
    api_key = factory.SubFactory(ApiKeyFactory)
    team = factory.LazyAttribute(lambda r: r.api_key.team)
    user = factory.LazyAttribute(lambda r: r.api_key.user)
    model = "test-model"
    endpoint = "/v1/chat/completions"
    started_at = factory.LazyFunction(timezone.now)
