"""A team's files (/v1/files): uploads for batches and the batches' output and error files.

The bytes of a file live in ORCHARD_FILES_DIR/<team id>/<file id>, its row is a `StoredFile`
(inference/batch_models.py). A file is streamed to a temporary file in its team's folder while
its size and sha256 are computed, then renamed into place in the transaction that inserts its
row: a reader never sees a partial file, and a failed or refused upload leaves nothing behind
(a process killed mid-upload leaves a `.upload-*` file, which no row names).

A team's files together may take at most ORCHARD_FILE_STORAGE_BYTES_PER_TEAM. The check that
counts is made with the team's row locked, in the transaction that inserts the new row, so two
uploads of one team at once cannot both squeeze under the quota; an upload whose team is already
over it is refused before a byte is written. A batch's output files are never refused (its
results must not be lost): they count toward the quota, so the team's next uploads are refused
while it is over.

Every lookup is scoped to a team: another team's file id is as unknown as one that never
existed. A file that an active batch reads as its input is not deleted (`FileInUse`).
"""

from __future__ import annotations

import codecs
import contextlib
import hashlib
import os
import re
import tempfile
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from django.conf import settings
from django.db import transaction
from django.db.models import Q, Sum
from django.utils import timezone

from accounts.models import ApiKey, Team
from inference.batch_models import Batch, StoredFile

FILE_ID = re.compile(r"file-[0-9a-f]{24}")
UPLOAD_PURPOSES = (StoredFile.Purpose.BATCH,)
ERROR_TOO_LARGE = "The file is larger than the {limit:,} bytes a file may have."
ERROR_QUOTA = (
    "Your team's files use {used:,} bytes of its storage quota of {quota:,} bytes "
    "(ORCHARD_FILE_STORAGE_BYTES_PER_TEAM); {this_file}. Delete files (DELETE "
    "/v1/files/{{file_id}}) to make room."
)
ERROR_EMPTY = "The file is empty; a batch input file has one JSON request per line."
ERROR_NOT_UTF8 = (
    "The file is not UTF-8 text; a batch input file is JSONL (one JSON request per line)."
)
ERROR_PURPOSE = "Files may be uploaded for these purposes only: {purposes}."
ERROR_IN_USE = (
    "The file {file_id} is the input of batch {batch_id}, which is still {status}; delete it once "
    "the batch has ended (or cancel the batch)."
)


class FileError(ValueError):
    """A file refused; `message` says why and `code` names the reason for the API."""

    code = "invalid_file"

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class FileTooLarge(FileError):
    code = "file_too_large"


class FileQuotaExceeded(FileError):
    code = "storage_quota_exceeded"


class FileInUse(FileError):
    code = "file_in_use"


def _new_file_id() -> str:
    return f"file-{uuid.uuid4().hex[:24]}"


def _folder(team_id: int) -> Path:
    return Path(settings.ORCHARD_FILES_DIR) / str(int(team_id))


def _path(team_id: int, file_id: str) -> Path:
    # Ids come from _new_file_id; checked again here, as they become a path.
    assert FILE_ID.fullmatch(file_id), file_id
    return _folder(team_id) / file_id


def files_storage_used(*, team_id: int) -> int:
    """The bytes of the team's files, output files included."""
    used = StoredFile.objects.filter(team_id=team_id).aggregate(n=Sum("num_bytes"))["n"]
    return used or 0


def _quota_error(*, used: int, quota: int, this_file: str) -> FileQuotaExceeded:
    return FileQuotaExceeded(ERROR_QUOTA.format(used=used, quota=quota, this_file=this_file))


@dataclass(frozen=True)
class _Written:
    """A file's bytes, written to a temporary file of its team's folder."""

    temp_path: Path
    num_bytes: int
    sha256: str


def _write(
    team_id: int,
    chunks: Iterable[bytes],
    *,
    max_bytes: int | None = None,
    quota: tuple[int, int] | None = None,
    text: bool = False,
) -> _Written:
    """`chunks` into a new temporary file, stopping (and removing it) as soon as they pass
    `max_bytes` (FileTooLarge) or the room `quota` (the team's used bytes, its quota) leaves
    (FileQuotaExceeded), or, with `text`, once they are not UTF-8 or turn out empty."""
    room = None if quota is None else quota[1] - quota[0]
    folder = _folder(team_id)
    folder.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=".upload-", dir=folder)
    temp_path = Path(name)
    digest = hashlib.sha256()
    decoder = codecs.getincrementaldecoder("utf-8")() if text else None
    size = 0
    try:
        with os.fdopen(fd, "wb") as out:
            for chunk in chunks:
                size += len(chunk)
                if max_bytes is not None and size > max_bytes:
                    raise FileTooLarge(ERROR_TOO_LARGE.format(limit=max_bytes))
                if room is not None and size > room:
                    raise _quota_error(
                        used=quota[0],
                        quota=quota[1],
                        this_file=f"this file (over {room:,} bytes) would exceed it",
                    )
                if decoder is not None:
                    try:
                        decoder.decode(chunk)
                    except UnicodeDecodeError:
                        raise FileError(ERROR_NOT_UTF8) from None
                digest.update(chunk)
                out.write(chunk)
            if decoder is not None:
                try:
                    decoder.decode(b"", final=True)  # a character cut off at the end
                except UnicodeDecodeError:
                    raise FileError(ERROR_NOT_UTF8) from None
                if size == 0:
                    raise FileError(ERROR_EMPTY)
            out.flush()
            os.fsync(out.fileno())  # the bytes are on disk before a row names them
    except BaseException:
        temp_path.unlink(missing_ok=True)
        raise
    return _Written(temp_path, size, digest.hexdigest())


def _store(
    written: _Written,
    *,
    team_id: int,
    api_key_id: int | None,
    purpose: str,
    filename: str,
    quota: int | None,
) -> StoredFile:
    """The row of `written`, inserted with its bytes renamed into place; with `quota`, refused
    (FileQuotaExceeded) if the team's files would pass it. Nothing is left on disk on failure."""
    file_id = _new_file_id()
    path = _path(team_id, file_id)
    try:
        with transaction.atomic():
            if quota is not None:
                # The team's row, locked: concurrent uploads of a team count one after another
                # (SQLite: every write transaction is BEGIN IMMEDIATE, so they are serial anyway).
                Team.objects.select_for_update().filter(pk=team_id).values_list("pk").get()
                used = files_storage_used(team_id=team_id)
                if used + written.num_bytes > quota:
                    raise _quota_error(
                        used=used,
                        quota=quota,
                        this_file=f"this file ({written.num_bytes:,} bytes) would exceed it",
                    )
            stored = StoredFile(
                id=file_id,
                team_id=team_id,
                api_key_id=api_key_id,
                purpose=purpose,
                filename=filename.replace("\x00", "")[:255],
                num_bytes=written.num_bytes,
                sha256=written.sha256,
                created_at=timezone.now(),
            )
            stored.save(force_insert=True)
            # Renamed before the commit: if the commit fails the bytes are removed below; once
            # it succeeds the row's bytes are there (a crash in between leaves bytes no row
            # names, never a row without bytes).
            os.replace(written.temp_path, path)
    except BaseException:
        written.temp_path.unlink(missing_ok=True)
        path.unlink(missing_ok=True)
        raise
    return stored


def file_create(
    *, api_key: ApiKey, purpose: str, filename: str, chunks: Iterable[bytes]
) -> StoredFile:
    """A team's upload: `chunks` (a JSONL file of UTF-8 text) stored as a new file of the key's
    team. Refused with FileTooLarge past ORCHARD_FILE_MAX_BYTES (reading stops there),
    FileQuotaExceeded past the team's ORCHARD_FILE_STORAGE_BYTES_PER_TEAM, FileError for another
    purpose than "batch", an empty file or one that is not UTF-8."""
    if purpose not in UPLOAD_PURPOSES:
        raise FileError(ERROR_PURPOSE.format(purposes=", ".join(UPLOAD_PURPOSES)))
    team_id = api_key.team_id
    quota = settings.ORCHARD_FILE_STORAGE_BYTES_PER_TEAM
    used = files_storage_used(team_id=team_id)
    if used >= quota:
        # Over already (its output files may take it past): refused before a byte is written.
        raise _quota_error(used=used, quota=quota, this_file="no room is left")
    written = _write(
        team_id,
        chunks,
        max_bytes=settings.ORCHARD_FILE_MAX_BYTES,
        quota=(used, quota),  # a first check that stops early; _store's is the one that counts
        text=True,
    )
    return _store(
        written,
        team_id=team_id,
        api_key_id=api_key.pk,
        purpose=purpose,
        filename=filename,
        quota=quota,
    )


def file_create_output(
    *, team_id: int, api_key_id: int | None, filename: str, chunks: Iterable[bytes]
) -> StoredFile:
    """A batch's output or error file (purpose "batch_output"), written as atomically as an
    upload but never refused for its size or the team's quota: a batch's results are kept.
    They count toward the quota (the team's next uploads are refused while it is over)."""
    written = _write(team_id, chunks)
    return _store(
        written,
        team_id=team_id,
        api_key_id=api_key_id,
        purpose=StoredFile.Purpose.BATCH_OUTPUT,
        filename=filename,
        quota=None,
    )


def file_get(*, team_id: int, file_id: str) -> StoredFile | None:
    """The team's file `file_id`, or None (also for another team's)."""
    if not FILE_ID.fullmatch(file_id):
        return None
    return StoredFile.objects.filter(team_id=team_id, pk=file_id).first()


def file_list(
    *,
    team_id: int,
    purpose: str | None = None,
    after: str | None = None,
    limit: int,
    order: str = "desc",
) -> tuple[list[StoredFile], bool]:
    """One page of the team's files by creation time (`order` "desc": newest first), those of
    `purpose` only if given, starting after the file `after` (the last id of the previous
    page; an unknown one is an empty page), and whether more follow."""
    rows = StoredFile.objects.filter(team_id=team_id)
    if purpose is not None:
        rows = rows.filter(purpose=purpose)
    descending = order == "desc"
    if after is not None:
        anchor = file_get(team_id=team_id, file_id=after)
        if anchor is None:
            return [], False
        at, pk = anchor.created_at, anchor.pk
        if descending:
            rows = rows.filter(Q(created_at__lt=at) | Q(created_at=at, pk__lt=pk))
        else:
            rows = rows.filter(Q(created_at__gt=at) | Q(created_at=at, pk__gt=pk))
    rows = rows.order_by(*(("-created_at", "-pk") if descending else ("created_at", "pk")))
    page = list(rows[: limit + 1])
    return page[:limit], len(page) > limit


def file_open(stored: StoredFile) -> BinaryIO:
    """The bytes of `stored`, to read; FileNotFoundError if it was deleted meanwhile. A file
    deleted while open stays readable to the end (POSIX unlink)."""
    return open(_path(stored.team_id, stored.pk), "rb")


def file_delete(*, team_id: int, file_id: str) -> bool:
    """Delete the team's file `file_id`, row and bytes; False if the team has no such file.
    FileInUse if an active batch reads it as its input. Batches whose output or error file it
    was keep their other results (the reference is set to null)."""
    if not FILE_ID.fullmatch(file_id):
        return False
    with transaction.atomic():
        # Locked: a batch created from this file at the same time (locking it likewise) either
        # sees it gone or is seen here.
        stored = StoredFile.objects.select_for_update().filter(team_id=team_id, pk=file_id).first()
        if stored is None:
            return False
        reader = (
            Batch.objects.filter(input_file_id=file_id, status__in=Batch.ACTIVE_STATES)
            .values("id", "status")
            .first()
        )
        if reader is not None:
            raise FileInUse(
                ERROR_IN_USE.format(file_id=file_id, batch_id=reader["id"], status=reader["status"])
            )
        stored.delete()
        path = _path(team_id, file_id)
        transaction.on_commit(lambda: _remove(path))
    return True


def _remove(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
