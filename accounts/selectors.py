"""Reads for teams, keys and budgets, scoped to what a user may see.

Visibility rules (one place, so the admin, reports and APIs agree):
- superusers see everything;
- a team's owners see all of the team's keys; a member sees only the keys issued to them;
- any member sees the team itself (and, in inference, the team's usage);
- only a team's owners change its keys and memberships (members' own keys are read-only to them);
- nobody sees another team's anything.
"""

import datetime

from django.contrib.auth.models import AbstractBaseUser
from django.db.models import Count, Q, QuerySet, Sum
from django.utils import timezone

from accounts.models import ApiKey, ApiKeyMonthlyUsage, Membership, Team


def month_start(day: datetime.date) -> datetime.date:
    return day.replace(day=1)


def api_key_month_tokens(*, api_key_id: int, month: datetime.date) -> int:
    """Tokens the key used in the calendar month starting at `month` (finished requests only),
    its playground keys' included: they spend its budget."""
    rows = ApiKeyMonthlyUsage.objects.filter(month=month).filter(
        Q(api_key_id=api_key_id) | Q(api_key__parent_id=api_key_id)
    )
    return rows.aggregate(tokens=Sum("tokens"))["tokens"] or 0


def teams_visible_to(*, user: AbstractBaseUser) -> QuerySet[Team]:
    if user.is_superuser:
        return Team.objects.all()
    return Team.objects.filter(memberships__user=user).distinct()


def teams_owned_by(*, user: AbstractBaseUser) -> QuerySet[Team]:
    if user.is_superuser:
        return Team.objects.all()
    return Team.objects.filter(
        memberships__user=user, memberships__role=Membership.Role.OWNER
    ).distinct()


def team_summaries_owned_by(*, user: AbstractBaseUser) -> QuerySet[Team]:
    """The teams the user owns (superusers: every team), each with `num_members` and
    `num_active_keys` (playground keys not counted)."""
    now = timezone.now()
    active = Q(
        api_keys__revoked_at__isnull=True,
        api_keys__parent__isnull=True,
    ) & (Q(api_keys__expires_at__isnull=True) | Q(api_keys__expires_at__gt=now))
    # Counted over a subquery of the owned teams: counting over the filter's own join would
    # count only the user's owner memberships.
    return (
        Team.objects.filter(pk__in=teams_owned_by(user=user).values("pk"))
        .annotate(
            num_members=Count("memberships", distinct=True),
            num_active_keys=Count("api_keys", filter=active, distinct=True),
        )
        .order_by("name")
    )


def teams_for_new_keys(*, user: AbstractBaseUser) -> QuerySet[Team]:
    """The teams the user may make keys in on their own: those they own, and those whose owners
    let members make their own keys."""
    members_allowed = Team.objects.filter(
        memberships__user=user, memberships__role=Membership.Role.MEMBER, members_manage_keys=True
    ).values("pk")
    return Team.objects.filter(
        Q(pk__in=teams_owned_by(user=user).values("pk")) | Q(pk__in=members_allowed)
    )


def api_keys_visible_to(*, user: AbstractBaseUser) -> QuerySet[ApiKey]:
    if user.is_superuser:
        return ApiKey.objects.all()
    owned = Team.objects.filter(memberships__user=user, memberships__role=Membership.Role.OWNER)
    member_of = Team.objects.filter(memberships__user=user)
    return ApiKey.objects.filter(team__in=owned) | ApiKey.objects.filter(
        user=user, team__in=member_of
    )


def api_keys_managed_by(*, user: AbstractBaseUser) -> QuerySet[ApiKey]:
    """The keys the user may change, revoke or rotate: those of the teams they own."""
    if user.is_superuser:
        return ApiKey.objects.all()
    return ApiKey.objects.filter(team__in=teams_owned_by(user=user))


def playground_parent_keys(*, user: AbstractBaseUser) -> QuerySet[ApiKey]:
    """The keys the playground may make a key from: the user's own active keys, not playground
    keys themselves."""
    return (
        ApiKey.objects.active()
        .filter(user=user, parent__isnull=True)
        .select_related("team")
        .order_by("team__name", "-created_at")
    )
