"""Reads of batches and files for the member pages and the admin, scoped to what a user may see
(accounts/selectors.py has the rules).

The members' Batches page shows the batches of the teams the user is a member of, as the API
shows a key its team's batches; a superuser's page is no wider (like "My usage"): every team's
batches are in the admin, which reads `batches_visible_to`. A member cancels the batches made
with their own keys, and a team's owners any of the team's, as the keys page lets them revoke
keys (a key holder can cancel through the API anyway).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from django.contrib.auth.models import AbstractBaseUser
from django.db.models import QuerySet

from accounts.models import Team
from accounts.selectors import teams_owned_by, teams_visible_to
from inference.batch_models import Batch, StoredFile
from inference.batches.files import FILE_ID

CANCELLABLE_STATES = (Batch.Status.VALIDATING, Batch.Status.IN_PROGRESS)


def _member_teams(user: AbstractBaseUser) -> QuerySet[Team]:
    return Team.objects.filter(memberships__user=user)


def member_batches(*, user: AbstractBaseUser) -> QuerySet[Batch]:
    """The batches of the teams the user is a member of, newest first."""
    return (
        Batch.objects.filter(team__in=_member_teams(user))
        .select_related("team", "api_key", "input_file", "output_file", "error_file")
        .order_by("-created_at", "-id")
    )


def member_batch_get(*, user: AbstractBaseUser, batch_id: str) -> Batch | None:
    """One batch of the user's teams, or None (also for another team's)."""
    return member_batches(user=user).filter(id=batch_id).first()


def member_file_get(*, user: AbstractBaseUser, file_id: str) -> StoredFile | None:
    """One file of the user's teams (an upload, a batch's output or error file), or None (also
    for another team's)."""
    if not FILE_ID.fullmatch(file_id):
        return None
    return StoredFile.objects.filter(team__in=_member_teams(user), pk=file_id).first()


@dataclass(frozen=True)
class BatchRights:
    """What the user may see of and do with their teams' batches: a batch's key is shown, and
    the batch cancelled, to the key's holder and the team's owners."""

    user_id: int
    owned_team_ids: frozenset[int]

    def holds(self, batch: Batch) -> bool:
        key = batch.api_key
        return batch.team_id in self.owned_team_ids or (
            key is not None and key.user_id == self.user_id
        )

    def may_cancel(self, batch: Batch) -> bool:
        return batch.status in CANCELLABLE_STATES and self.holds(batch)


def batch_rights(*, user: AbstractBaseUser) -> BatchRights:
    owned = teams_owned_by(user=user).filter(pk__in=_member_teams(user).values("pk"))
    return BatchRights(user.pk, frozenset(owned.values_list("pk", flat=True)))


def batch_finished_at(batch: Batch) -> datetime | None:
    """When the batch ended (completed, failed, expired or cancelled); None while it runs."""
    return batch.completed_at or batch.failed_at or batch.expired_at or batch.cancelled_at


def batches_visible_to(*, user: AbstractBaseUser) -> QuerySet[Batch]:
    """The admin's batches: every one for superusers, else those of the teams the user sees."""
    if user.is_superuser:
        return Batch.objects.all()
    return Batch.objects.filter(team__in=teams_visible_to(user=user))


def batches_managed_by(*, user: AbstractBaseUser) -> QuerySet[Batch]:
    """The batches the admin lets the user cancel: those of the teams they own (superusers:
    all), as with the requests running now."""
    return Batch.objects.filter(team__in=teams_owned_by(user=user))


def files_visible_to(*, user: AbstractBaseUser) -> QuerySet[StoredFile]:
    """The admin's files: every one for superusers, else those of the teams the user sees."""
    if user.is_superuser:
        return StoredFile.objects.all()
    return StoredFile.objects.filter(team__in=teams_visible_to(user=user))
