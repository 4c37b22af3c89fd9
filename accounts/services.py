"""Writes for teams, memberships and API keys, the rules for the keys members make themselves
(the members' pages), and the sign-in throttle's counters in the database."""

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import date, datetime, timedelta
from typing import Any

from django.contrib.auth import get_user_model
from django.contrib.auth.models import AbstractBaseUser
from django.db import IntegrityError, transaction
from django.db.models import F
from django.utils import timezone

from accounts import keys
from accounts.models import (
    DEFAULT_SERVICE_TIERS,
    ApiKey,
    ApiKeyMonthlyUsage,
    Membership,
    SigninAttempts,
    Team,
    validate_service_tiers,
)
from accounts.selectors import playground_parent_keys, teams_for_new_keys, teams_owned_by
from engine import SERVICE_TIERS

# last_used_at is written at most this often per key, so hot keys don't cost a write per request.
LAST_USED_RESOLUTION_SECONDS = 60
MEMBER_KEYS_MAX = 10  # active keys a member may hold per team (owners: no cap)
ERROR_MEMBER_KEYS_MAX = "You have {active} active keys in {team}; revoke one first."
ERROR_OWNERS_MANAGE_KEYS = "This team's keys are made and revoked by its owners."
PLAYGROUND_KEY_LIFETIME = timedelta(hours=1)
PLAYGROUND_KEYS_MAX = 5  # active playground keys a user holds at once: one per open page
ERROR_PLAYGROUND_PARENT = "Choose one of your own active keys."
ERROR_PLAYGROUND_MODEL = "That key may not use {model}."
ERROR_PLAYGROUND_KEYS_MAX = (
    "You have {active} playground keys in use (one per open playground page): close a page, or "
    "sign out to end them all."
)


class MemberKeyRefused(Exception):
    """A team's rules refuse what a member asked of their own keys; the message says why."""


class PlaygroundKeyRefused(Exception):
    """The playground cannot make this key; the message says why."""


@transaction.atomic
def team_membership_ensure(
    *, user: AbstractBaseUser, team_name: str, role: str | None = None
) -> tuple[Team, Membership]:
    """The team (created if missing) and the user's membership in it. The creator of a new team
    becomes its owner."""
    team, created = Team.objects.get_or_create(name=team_name)
    default_role = Membership.Role.OWNER if created else Membership.Role.MEMBER
    membership, _ = Membership.objects.get_or_create(
        team=team, user=user, defaults={"role": role or default_role}
    )
    return team, membership


def user_get_or_create(*, username: str) -> AbstractBaseUser:
    user, _ = get_user_model().objects.get_or_create(username=username)
    return user


@transaction.atomic
def api_key_create(
    *,
    user: AbstractBaseUser,
    team: Team,
    name: str = "",
    models: list[str] | None = None,
    rpm: int | None = None,
    tpm: int | None = None,
    max_parallel: int | None = None,
    budget_tokens: int | None = None,
    max_output_tokens: int | None = None,
    expires_at: datetime | None = None,
    created_by: AbstractBaseUser | None = None,
    creation_token: str | None = None,
    reads_usage: bool = False,
    service_tiers: Iterable[str] = DEFAULT_SERVICE_TIERS,
    parent: ApiKey | None = None,
) -> tuple[ApiKey, str]:
    """Create a key; returns it with the raw key, which is not stored and cannot be shown again.
    `models=None` allows every model; `creation_token` makes a form submission create one key
    however often it is resubmitted (it is unique); `service_tiers` (names of
    engine.SERVICE_TIERS) are the tiers its requests may ask for (ValidationError otherwise)."""
    tiers = service_tiers_ordered(service_tiers)
    validate_service_tiers(tiers)
    raw_key = keys.generate_key()
    api_key = ApiKey.objects.create(
        prefix=keys.lookup_prefix(raw_key),
        digest=keys.digest(raw_key),
        name=name,
        team=team,
        user=user,
        created_by=created_by,
        all_models=models is None,
        allowed_models=sorted(set(models or [])),
        rpm=rpm,
        tpm=tpm,
        max_parallel=max_parallel,
        budget_tokens=budget_tokens,
        max_output_tokens=max_output_tokens,
        reads_usage=reads_usage,
        service_tiers=tiers,
        expires_at=expires_at,
        creation_token=creation_token,
        parent=parent,
    )
    return api_key, raw_key


def service_tiers_ordered(tiers: Iterable[str]) -> list[str]:
    """`tiers` without repeats, highest first (unknown names kept, last, for the validator
    to name)."""
    given = list(dict.fromkeys(tiers))
    return [t for t in SERVICE_TIERS if t in given] + [t for t in given if t not in SERVICE_TIERS]


@transaction.atomic
def member_key_create(
    *, user: AbstractBaseUser, team: Team, name: str = "", creation_token: str | None = None
) -> tuple[ApiKey, str | None]:
    """A key the user makes for themselves in `team` (one of `teams_for_new_keys`): an owner's
    has no limits; a member's gets the team's member-key limits and models, and a member holds at
    most MEMBER_KEYS_MAX active keys in a team. Either gets the default service tiers (priority
    is granted in the admin only). Returns the key and its raw value, or, for a form sent again
    (its `creation_token` made a key already), that key and None: one key however often the
    form is sent, even twice at once. Raises MemberKeyRefused."""
    if creation_token:
        existing = ApiKey.objects.filter(creation_token=creation_token, user=user).first()
        if existing is not None:
            return existing, None
    if not teams_for_new_keys(user=user).filter(pk=team.pk).exists():
        raise MemberKeyRefused(ERROR_OWNERS_MANAGE_KEYS)
    limits = {}
    if not teams_owned_by(user=user).filter(pk=team.pk).exists():
        # Under the team's row lock, so that two forms sent at once cannot both pass the cap.
        team = Team.objects.select_for_update().get(pk=team.pk)
        active = ApiKey.objects.active().filter(user=user, team=team, parent=None).count()
        if active >= MEMBER_KEYS_MAX:
            raise MemberKeyRefused(ERROR_MEMBER_KEYS_MAX.format(active=active, team=team))
        limits = {
            "rpm": team.member_key_rpm,
            "tpm": team.member_key_tpm,
            "budget_tokens": team.member_key_budget_tokens,
            "models": list(team.member_key_models) or None,
        }
    try:
        with transaction.atomic():
            return api_key_create(
                user=user,
                team=team,
                name=name,
                created_by=user,
                creation_token=creation_token,
                **limits,
            )
    except IntegrityError:
        # The same form sent twice at once: the other request made the key.
        existing = ApiKey.objects.filter(creation_token=creation_token, user=user).first()
        if existing is None:
            raise
        return existing, None


def member_key_revoke(*, user: AbstractBaseUser, key_id: int) -> ApiKey:
    """Revoke one of the user's own keys, where its team lets members manage their keys (its
    owners always may). Raises ApiKey.DoesNotExist for a key that is not theirs, and
    MemberKeyRefused where the team's owners revoke keys."""
    api_key = ApiKey.objects.select_related("team").get(pk=key_id, user=user)
    owner = teams_owned_by(user=user).filter(pk=api_key.team_id).exists()
    if not (owner or api_key.team.members_manage_keys):
        raise MemberKeyRefused(ERROR_OWNERS_MANAGE_KEYS)
    return api_key_revoke(api_key=api_key)


@transaction.atomic
def playground_key_create(
    *, user: AbstractBaseUser, parent_id: int, model: str
) -> tuple[ApiKey, str]:
    """A key for the playground page, made from one of the user's own active keys (`parent_id`):
    for `model` only (one the parent allows), for PLAYGROUND_KEY_LIFETIME at most (never past the
    parent's expiry), with the parent's service tiers and output ceiling, and no limits of its
    own: it spends the parent's rpm, tpm, parallel slots and budget (accounts/limits). It holds
    nothing the parent does not, so any member may make one, whether or not their team lets
    members make keys. Returns it with its raw value; raises PlaygroundKeyRefused."""
    # The user's row lock: two pages opened at once cannot both pass the cap.
    get_user_model().objects.select_for_update().filter(pk=user.pk).first()
    parent = playground_parent_keys(user=user).filter(pk=parent_id).first()
    if parent is None:
        raise PlaygroundKeyRefused(ERROR_PLAYGROUND_PARENT)
    if not parent.allows_model(model):
        raise PlaygroundKeyRefused(ERROR_PLAYGROUND_MODEL.format(model=model))
    active = ApiKey.objects.active().filter(user=user, parent__isnull=False).count()
    if active >= PLAYGROUND_KEYS_MAX:
        raise PlaygroundKeyRefused(ERROR_PLAYGROUND_KEYS_MAX.format(active=active))
    expires_at = timezone.now() + PLAYGROUND_KEY_LIFETIME
    if parent.expires_at is not None:
        expires_at = min(expires_at, parent.expires_at)
    return api_key_create(
        user=user,
        team=parent.team,
        name=f"Playground: {model} (from {parent.prefix}…)"[:100],
        models=[model],
        max_output_tokens=parent.max_output_tokens,
        expires_at=expires_at,
        created_by=user,
        service_tiers=parent.service_tiers,
        parent=parent,
    )


def playground_key_revoke(*, user: AbstractBaseUser, key_id: int) -> bool:
    """Revoke one of the user's playground keys (the page was left); False when there was no
    such active key."""
    keys_held = ApiKey.objects.filter(pk=key_id, user=user, parent__isnull=False)
    return bool(keys_held.filter(revoked_at__isnull=True).update(revoked_at=timezone.now()))


def playground_keys_revoke_for_user(*, user_id: int) -> int:
    """Revoke the user's playground keys (they signed out); returns how many were active."""
    keys_held = ApiKey.objects.filter(user_id=user_id, parent__isnull=False, revoked_at=None)
    return keys_held.update(revoked_at=timezone.now())


def api_key_find(*, key_or_prefix: str) -> ApiKey:
    """The key named by a raw key or its displayed prefix; raises ApiKey.DoesNotExist."""
    given = key_or_prefix.strip().rstrip("…")
    if len(given) < keys.LOOKUP_PREFIX_LENGTH:
        raise ApiKey.DoesNotExist("Give the whole displayed prefix or the key.")
    api_key = ApiKey.objects.get(prefix=keys.lookup_prefix(given))
    if len(given) > keys.LOOKUP_PREFIX_LENGTH and not keys.digest_matches(given, api_key.digest):
        raise ApiKey.DoesNotExist("No key matches.")
    return api_key


def api_key_revoke(*, api_key: ApiKey) -> ApiKey:
    """Revoke the key (a no-op if it already is). Authentication reads the key from the database
    on every request, so the next request with it gets 401 in every process. Its playground
    keys end with it (authentication refuses them anyway)."""
    now = timezone.now()
    ApiKey.objects.filter(pk=api_key.pk, revoked_at__isnull=True).update(revoked_at=now)
    ApiKey.objects.filter(parent=api_key, revoked_at__isnull=True).update(revoked_at=now)
    api_key.refresh_from_db(fields=["revoked_at"])
    return api_key


def api_keys_revoke_for_member(*, team_id: int, user_id: int) -> int:
    """Revoke the keys the user holds in the team, because they are no longer a member of it;
    returns how many were active. Called wherever a membership ends (accounts/signals.py)."""
    keys_held = ApiKey.objects.filter(team_id=team_id, user_id=user_id, revoked_at__isnull=True)
    return keys_held.update(revoked_at=timezone.now())


def api_keys_revoke_for_user(*, user_id: int) -> int:
    """Revoke every key the user holds, in every team (the account was deactivated); returns how
    many were active. Reactivating the account does not bring them back: issue new ones."""
    keys_held = ApiKey.objects.filter(user_id=user_id, revoked_at__isnull=True)
    return keys_held.update(revoked_at=timezone.now())


def api_key_touch_last_used(*, api_key: ApiKey, now: datetime) -> None:
    """Record a use of the key at `now`, unless one was recorded in the last
    LAST_USED_RESOLUTION_SECONDS (updates `api_key` in place too)."""
    last = api_key.last_used_at
    if last is None or (now - last).total_seconds() >= LAST_USED_RESOLUTION_SECONDS:
        ApiKey.objects.filter(pk=api_key.pk).update(last_used_at=now)
        api_key.last_used_at = now


@transaction.atomic
def api_key_rotate(
    *, api_key: ApiKey, created_by: AbstractBaseUser | None = None
) -> tuple[ApiKey, str]:
    """A new key with the old one's team, owner, label, models, limits, service tiers and expiry;
    the old key is revoked in the same transaction. Returns the new key and its raw value."""
    new_key, raw_key = api_key_create(
        user=api_key.user,
        team=api_key.team,
        name=api_key.name,
        models=None if api_key.all_models else list(api_key.allowed_models),
        rpm=api_key.rpm,
        tpm=api_key.tpm,
        max_parallel=api_key.max_parallel,
        budget_tokens=api_key.budget_tokens,
        max_output_tokens=api_key.max_output_tokens,
        expires_at=api_key.expires_at,
        service_tiers=api_key.service_tiers,
        created_by=created_by,
    )
    api_key_revoke(api_key=api_key)
    return new_key, raw_key


@dataclass(frozen=True)
class Invitation:
    """What `member_invite` did: the user (`user_created` when it made the account), the
    membership (`joined` when it made it) and the key with its raw value, shown once."""

    user: AbstractBaseUser
    user_created: bool
    membership: Membership
    joined: bool
    api_key: ApiKey | None
    raw_key: str | None


@transaction.atomic
def member_invite(
    *,
    team: Team,
    username: str,
    email: str = "",
    password: str | None = None,
    role: str = Membership.Role.MEMBER,
    key: Mapping[str, Any] | None = None,
    created_by: AbstractBaseUser | None = None,
) -> Invitation:
    """Onboard one member in one step: the user (made when `username` is new, with `password`,
    or with none usable until they set one), their membership of `team` in `role` (an existing
    membership is left as it is), and, when `key` is given (api_key_create's arguments but the
    user, team and creator), their key. All or nothing."""
    user_model = get_user_model()
    user = user_model.objects.filter(username=username).first()
    user_created = user is None
    if user_created:
        user = user_model(username=username, email=email)
        if password:
            user.set_password(password)
        else:
            user.set_unusable_password()  # until they follow their set-password link
        user.save()
    membership, joined = Membership.objects.get_or_create(
        team=team, user=user, defaults={"role": role}
    )
    api_key = raw_key = None
    if key is not None:
        api_key, raw_key = api_key_create(user=user, team=team, created_by=created_by, **key)
    return Invitation(user, user_created, membership, joined, api_key, raw_key)


def api_key_monthly_usage_add(*, api_key_id: int, month: date, tokens: int) -> None:
    """Add tokens to the key's month. Call inside the transaction that records the usage, so the
    budget seed and the usage rows never disagree."""
    row, _ = ApiKeyMonthlyUsage.objects.select_for_update().get_or_create(
        api_key_id=api_key_id, month=month
    )
    ApiKeyMonthlyUsage.objects.filter(pk=row.pk).update(tokens=F("tokens") + tokens)


@transaction.atomic
def signin_attempts_count(*, keys: list[str], window_seconds: float) -> dict[str, int]:
    """Count one sign-in attempt against each counter and return each counter's attempts in its
    window, this one included. A counter's window starts with its first attempt; an expired one
    starts again. Exact under concurrent attempts: each increment is one UPDATE of the row, which
    holds its lock to the end of the transaction, and counters are taken in one order, so two
    attempts never wait on each other."""
    now = timezone.now()
    expires_at = now + timedelta(seconds=window_seconds)
    counts = {}
    for key in sorted(set(keys)):
        rows = SigninAttempts.objects.filter(key=key)
        rows.filter(expires_at__lte=now).update(count=0, expires_at=expires_at)
        while not rows.update(count=F("count") + 1):
            try:
                with transaction.atomic():
                    SigninAttempts.objects.create(key=key, count=1, expires_at=expires_at)
                break
            except IntegrityError:
                continue  # another attempt created it a moment ago: count on that row
        counts[key] = rows.values_list("count", flat=True).get()
    return counts


def signin_attempts_forgive(*, clear: list[str], discount: list[str]) -> None:
    """After a successful sign-in: the `clear` counters start again, the `discount` ones take
    back the attempt (it was counted before the password was checked)."""
    SigninAttempts.objects.filter(key__in=clear).delete()
    SigninAttempts.objects.filter(
        key__in=discount, expires_at__gt=timezone.now(), count__gt=0
    ).update(count=F("count") - 1)


@transaction.atomic
def signin_attempts_purge(*, batch: int = 1000) -> int:
    """Delete up to `batch` counters whose window has passed; returns how many. Rows an attempt
    holds are skipped (SKIP LOCKED), so a purge never waits on, or deadlocks with, an attempt."""
    now = timezone.now()
    stale = SigninAttempts.objects.filter(expires_at__lte=now).select_for_update(skip_locked=True)
    ids = list(stale.values_list("pk", flat=True)[:batch])
    deleted, _ = SigninAttempts.objects.filter(pk__in=ids, expires_at__lte=now).delete()
    return deleted
