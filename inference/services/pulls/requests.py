"""Asking for a pull and cancelling one: the checks a request passes before a row is made (the
same from the admin's form and `manage.py pull`), and what the pages read of the rows."""

from __future__ import annotations

import re
from pathlib import Path

from django.conf import settings
from django.contrib.auth.models import AbstractBaseUser
from django.db import IntegrityError, transaction
from django.db.models import QuerySet
from django.utils import timezone

from engine import GROUP_SIZES, QUANTIZE_BITS, parse_source
from inference.models import ModelEntry, ModelPull
from inference.services.pulls.claims import MESSAGE_CANCELLED, pull_claim, pull_is_stale

DEFAULT_GROUP_SIZE = 64
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")

ERROR_REVISION_TWICE = "Give the revision once: as ID@REVISION or as the revision, not both."
ERROR_NAME = (
    "{name!r} cannot be a model name: use letters, digits, '.', '_' and '-' (it is also the "
    "folder's name), at most 100 characters."
)
ERROR_NAME_TAKEN = "A model called {name!r} is registered already: choose another name."
ERROR_FOLDER_TAKEN = "{folder} exists already: choose another name, or remove the folder."
ERROR_NAME_PULLING = "A pull into {name!r} is under way already (pull #{pk})."
ERROR_SOURCE_PULLING = (
    "{source} is being pulled already (pull #{pk}, as {name!r}); wait for it to finish."
)
ERROR_BITS = "Quantize to 4 or 8 bits (or not at all), not {bits!r}."
ERROR_GROUP_SIZE = "The group size is 32, 64 or 128, not {size!r}."
ERROR_EMBEDDING_QUANTIZED = "Embedding models are served as pulled: they are not quantized."
ERROR_KIND = "Unknown kind {kind!r}; choose from chat, embedding."


class PullRequestError(ValueError):
    """A pull that cannot be asked for (the message says why); nothing was made."""


def default_name(repo_id: str, bits: int | None) -> str:
    """The registry name a pull gets unless one is given: the repo's name, lower case, with the
    bits when Orchard quantizes it (Qwen/Qwen3-0.6B --quantize 4: qwen3-0.6b-4bit)."""
    name = repo_id.rsplit("/", 1)[-1].lower()
    return f"{name}-{bits}bit" if bits else name


def pull_create(
    *,
    source: str,
    revision: str | None = None,
    name: str | None = None,
    kind: str = ModelEntry.Kind.CHAT,
    bits: int | None = None,
    group_size: int = DEFAULT_GROUP_SIZE,
    started_by: AbstractBaseUser | None = None,
    origin: str = ModelPull.Origin.ADMIN,
    runner: str = "",
) -> ModelPull:
    """A queued pull of `source` (`org/name` or `org/name@revision`) into the registry name
    `name`. With `runner` the row is made already claimed by it (`manage.py pull` runs its own).
    Raises PullRequestError for anything the pull could not do."""
    try:
        repo_id, inline_revision = parse_source(source)
    except ValueError as exc:
        raise PullRequestError(str(exc)) from None
    revision = (revision or "").strip() or None
    if inline_revision and revision and inline_revision != revision:
        raise PullRequestError(ERROR_REVISION_TWICE)
    revision = inline_revision or revision
    if kind not in ModelEntry.Kind.values:
        raise PullRequestError(ERROR_KIND.format(kind=kind))
    if bits is not None and bits not in QUANTIZE_BITS:
        raise PullRequestError(ERROR_BITS.format(bits=bits))
    if group_size not in GROUP_SIZES:
        raise PullRequestError(ERROR_GROUP_SIZE.format(size=group_size))
    if bits is not None and kind == ModelEntry.Kind.EMBEDDING:
        raise PullRequestError(ERROR_EMBEDDING_QUANTIZED)
    name = (name or "").strip() or default_name(repo_id, bits)
    if not NAME.match(name):
        raise PullRequestError(ERROR_NAME.format(name=name))
    if runner:
        # The same pull, waiting or left by a process that stopped: this runner goes on with
        # it (its partial files included) rather than refusing it as a duplicate.
        same = ModelPull.objects.filter(
            state__in=ModelPull.ACTIVE_STATES,
            source=repo_id,
            revision=revision or "",
            name=name,
            kind=kind,
            quantize_bits=bits,
            group_size=group_size,
        ).first()
        if same is not None and (not same.runner or pull_is_stale(same)):
            taken = pull_claim(same, runner=runner)
            if taken is not None:
                return taken
    if ModelEntry.objects.filter(name=name).exists():
        raise PullRequestError(ERROR_NAME_TAKEN.format(name=name))
    folder = Path(settings.ORCHARD_MODELS_DIR) / name
    if folder.exists():
        raise PullRequestError(ERROR_FOLDER_TAKEN.format(folder=folder))
    now = timezone.now()
    claimed = {"runner": runner, "heartbeat_at": now, "attempts": 1, "started_at": now}
    try:
        with transaction.atomic():
            _refuse_if_pulling(repo_id=repo_id, name=name)
            return ModelPull.objects.create(
                source=repo_id,
                revision=revision or "",
                name=name,
                kind=kind,
                quantize_bits=bits,
                group_size=group_size,
                started_by=started_by if started_by and started_by.is_authenticated else None,
                origin=origin,
                **(claimed if runner else {}),
            )
    except IntegrityError:
        # A pull of the same name or repo was made meanwhile: say which.
        _refuse_if_pulling(repo_id=repo_id, name=name)
        raise


def _refuse_if_pulling(*, repo_id: str, name: str) -> None:
    active = ModelPull.objects.filter(state__in=ModelPull.ACTIVE_STATES)
    if same_name := active.filter(name=name).first():
        raise PullRequestError(ERROR_NAME_PULLING.format(name=name, pk=same_name.pk))
    if same_source := active.filter(source=repo_id).first():
        raise PullRequestError(
            ERROR_SOURCE_PULLING.format(source=repo_id, pk=same_source.pk, name=same_source.name)
        )


def pull_cancel(*, pull_id: int) -> bool:
    """Cancel a pull: a queued one at once, a running one by its runner within a second (it
    removes what it downloaded), one whose runner stopped when a runner takes it over. False
    when it is no longer active."""
    now = timezone.now()
    queued = ModelPull.objects.filter(pk=pull_id, state=ModelPull.State.QUEUED, runner="")
    if queued.update(state=ModelPull.State.CANCELLED, error=MESSAGE_CANCELLED, finished_at=now):
        return True
    active = ModelPull.objects.filter(pk=pull_id, state__in=ModelPull.ACTIVE_STATES)
    return bool(active.update(cancel_requested=True))


def pulls_recent(limit: int = 50) -> QuerySet[ModelPull]:
    return ModelPull.objects.select_related("started_by", "model").order_by("-created_at")[:limit]


def pull_eta_s(pull: ModelPull) -> float | None:
    if not pull.active or not pull.rate_bytes_per_s or not pull.total_bytes:
        return None
    return max(0.0, (pull.total_bytes - pull.done_bytes) / pull.rate_bytes_per_s)
