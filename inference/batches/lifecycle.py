"""A batch's way through its lifecycle, as its runner (runner.py) writes it: validating its input
file into lines, taking lines to run, recording their answers, stopping and finalizing (the
output and error files). Every write is conditional on the runner still holding the batch
(`Batch.runner`), so a runner that lost its claim to another cannot change what the other does.
"""

from __future__ import annotations

import datetime
import itertools
import json
import uuid
from collections.abc import Iterator
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import F
from django.utils import timezone

from accounts.authentication import AuthenticationError, api_key_still_valid
from inference.batch_models import Batch, BatchLine, StoredFile
from inference.batches.files import file_create_output, file_open
from inference.batches.lines import FileError, LinesReader

CHUNK = 1000  # input lines written a transaction
# Why lines that never ran end in the error file, by how the batch ended.
NOT_RUN = {
    # (None run normally: a line whose run broke off without an answer.)
    Batch.Status.COMPLETED: ("server_error", "The server had an error while running this request."),
    Batch.Status.CANCELLED: ("batch_cancelled", "The batch was cancelled before this request ran."),
    Batch.Status.EXPIRED: (
        "batch_expired",
        "This request could not be executed before the completion window expired.",
    ),
}
ERROR_NOT_RUN_AFTER_STOP = "The batch stopped before this request ran: {reason}"
ERROR_INPUT_GONE = "The input file was deleted before the batch was validated."


def _held(batch: Batch, runner: str):
    return Batch.objects.filter(pk=batch.pk, runner=runner)


def batch_validate(*, batch: Batch, runner: str) -> Batch:
    """Read the input file into lines, CHUNK lines a transaction (a large file is never held
    whole, nor the database locked while it is read), or fail the batch with its file's
    errors; then the batch is in progress. Until then the runner ignores its lines: a
    validation cut short starts again from the first."""
    stored = StoredFile.objects.filter(pk=batch.input_file_id).first()
    try:
        api_key = api_key_still_valid(batch.api_key_id)
    except AuthenticationError as exc:
        return _failed(batch, runner, [{"code": exc.code, "message": exc.message}])
    if stored is None:
        return _failed(batch, runner, [{"code": "file_not_found", "message": ERROR_INPUT_GONE}])
    reader = LinesReader(
        api_key=api_key, endpoint=batch.endpoint, max_lines=settings.ORCHARD_BATCH_MAX_LINES
    )
    now = timezone.now()
    refused = 0
    BatchLine.objects.filter(batch=batch).delete()
    try:
        with file_open(stored) as handle:
            for chunk in _chunks(reader.read(handle), CHUNK):
                if reader.errors or not _held(batch, runner).exists():
                    continue  # the batch fails (or is not ours): read on for its errors only
                rows = [_line_row(batch, line, now) for line in chunk]
                refused += sum(1 for row in rows if row.state == BatchLine.State.FAILED)
                BatchLine.objects.bulk_create(rows)
    except FileNotFoundError:
        reader.errors.append(FileError("file_not_found", ERROR_INPUT_GONE))
    if reader.errors:
        BatchLine.objects.filter(batch=batch).delete()
        return _failed(batch, runner, [error.as_dict() for error in reader.errors])
    _held(batch, runner).filter(status=Batch.Status.VALIDATING).update(
        status=Batch.Status.IN_PROGRESS,
        model=next(iter(reader.models), ""),
        num_total=reader.num_lines,
        num_failed=refused,
        in_progress_at=now,
    )
    return Batch.objects.get(pk=batch.pk)


def _chunks(items: Iterator, size: int) -> Iterator[list]:
    while chunk := list(itertools.islice(items, size)):
        yield chunk


def _failed(batch: Batch, runner: str, errors: list[dict]) -> Batch:
    errors = [{"param": None, "line": None, **error} for error in errors]
    _held(batch, runner).filter(status=Batch.Status.VALIDATING).update(
        status=Batch.Status.FAILED, errors=errors, failed_at=timezone.now()
    )
    return Batch.objects.get(pk=batch.pk)


def _line_row(batch: Batch, line, now: datetime.datetime) -> BatchLine:
    row = BatchLine(
        batch=batch,
        index=line.index,
        custom_id=line.custom_id,
        request_id=f"batch_req_{uuid.uuid4().hex}",
        body=line.body,
    )
    if line.refusal is not None:
        row.state = BatchLine.State.FAILED
        row.status_code = line.refusal.status
        row.result = line.refusal.body()
        row.body = None
        row.finished_at = now
    return row


def lines_reset_running(*, batch: Batch) -> int:
    """Lines a stopped runner left running wait again (the usage row of their unfinished run
    is discarded when they run again: runner.py)."""
    return BatchLine.objects.filter(batch=batch, state=BatchLine.State.RUNNING).update(
        state=BatchLine.State.PENDING
    )


def batches_give_back(*, runner: str) -> int:
    """Give back every batch `runner` holds (its process stops): their running lines wait
    again, and the next runner claims them at once. Returns how many."""
    held = Batch.objects.filter(runner=runner)
    with transaction.atomic():
        BatchLine.objects.filter(batch__in=held, state=BatchLine.State.RUNNING).update(
            state=BatchLine.State.PENDING
        )
        return held.update(runner="", heartbeat_at=None)


def lines_take(*, batch: Batch, runner: str, limit: int) -> list[BatchLine]:
    """Up to `limit` waiting lines, in file order, marked running for `runner`."""
    taken = []
    for line in BatchLine.objects.filter(batch=batch, state=BatchLine.State.PENDING).order_by(
        "index"
    )[:limit]:
        if (
            BatchLine.objects.filter(pk=line.pk, state=BatchLine.State.PENDING)
            .filter(batch__runner=runner)
            .update(state=BatchLine.State.RUNNING, attempts=F("attempts") + 1)
        ):
            line.state = BatchLine.State.RUNNING
            taken.append(line)
    return taken


def line_finish(*, line: BatchLine, runner: str, status_code: int, body: dict[str, Any]) -> bool:
    """Record a line's answer and count it in its batch, in one transaction; False when the
    runner no longer holds the batch (nothing is written)."""
    done = 200 <= status_code < 300
    usage = _usage_of(body) if done else (0, 0, 0)
    with transaction.atomic():
        if not Batch.objects.filter(pk=line.batch_id, runner=runner).exists():
            return False
        updated = BatchLine.objects.filter(pk=line.pk, state=BatchLine.State.RUNNING).update(
            state=BatchLine.State.DONE if done else BatchLine.State.FAILED,
            status_code=status_code,
            result=body,
            body=None,
            finished_at=timezone.now(),
        )
        if updated:
            counter = "num_completed" if done else "num_failed"
            Batch.objects.filter(pk=line.batch_id).update(
                input_tokens=F("input_tokens") + usage[0],
                cached_tokens=F("cached_tokens") + usage[1],
                output_tokens=F("output_tokens") + usage[2],
                **{counter: F(counter) + 1},
            )
    return bool(updated)


def line_return(*, line: BatchLine) -> None:
    """A line stopped before its answer (the batch stopping): it waits again (finalizing
    reports it as not run)."""
    BatchLine.objects.filter(pk=line.pk, state=BatchLine.State.RUNNING).update(
        state=BatchLine.State.PENDING
    )


def _usage_of(body: dict[str, Any]) -> tuple[int, int, int]:
    """(input, cached input, output) tokens of an endpoint's answer."""
    usage = body.get("usage") or {}
    if "input_tokens" in usage:  # /v1/responses
        details = usage.get("input_tokens_details") or {}
        return usage["input_tokens"], details.get("cached_tokens", 0), usage["output_tokens"]
    details = usage.get("prompt_tokens_details") or {}
    return (
        usage.get("prompt_tokens", 0),
        details.get("cached_tokens", 0),
        usage.get("completion_tokens", 0),
    )


def batch_stop(
    *, batch: Batch, runner: str, ending: str, code: str = "", message: str = ""
) -> bool:
    """Move a batch the runner holds to `finalizing`, remembering how it is to end (`ending`:
    completed, cancelled, expired, or failed with an error `code` and `message`: a budget ran
    out, its key was revoked); False when it does not hold it."""
    return bool(
        _held(batch, runner)
        .exclude(status=Batch.Status.FINALIZING)
        .update(
            status=Batch.Status.FINALIZING,
            finalizing_at=timezone.now(),
            stop_reason=json.dumps([ending, code, message]),
        )
    )


def batch_finalize(*, batch: Batch, runner: str) -> Batch:
    """Write the output and error files of a finalizing batch and end it as its stop said."""
    batch = Batch.objects.get(pk=batch.pk)
    ending, code, message = json.loads(batch.stop_reason or '["completed", "", ""]')
    now = timezone.now()
    unrun = NOT_RUN.get(ending)
    if ending == Batch.Status.FAILED:
        unrun = (code, ERROR_NOT_RUN_AFTER_STOP.format(reason=message))
    if unrun is not None:
        num_unrun = BatchLine.objects.filter(
            batch=batch, state__in=(BatchLine.State.PENDING, BatchLine.State.RUNNING)
        ).update(
            state=BatchLine.State.FAILED,
            error={"code": unrun[0], "message": unrun[1]},
            body=None,
            finished_at=now,
        )
        Batch.objects.filter(pk=batch.pk).update(num_failed=F("num_failed") + num_unrun)
    with transaction.atomic():
        if not _held(batch, runner).filter(status=Batch.Status.FINALIZING).exists():
            return Batch.objects.get(pk=batch.pk)
        output = _file_of(batch, BatchLine.State.DONE, "output")
        error = _file_of(batch, BatchLine.State.FAILED, "error")
        fields = {
            "status": ending,
            "output_file": output,
            "error_file": error,
            f"{ending}_at": now,
        }
        if ending == Batch.Status.FAILED:
            fields["errors"] = [{"code": code, "message": message, "param": None, "line": None}]
        _held(batch, runner).update(**fields)
    return Batch.objects.get(pk=batch.pk)


def _file_of(batch: Batch, state: str, kind: str) -> StoredFile | None:
    lines = BatchLine.objects.filter(batch=batch, state=state).order_by("index")
    if not lines.exists():
        return None
    return file_create_output(
        team_id=batch.team_id,
        api_key_id=batch.api_key_id,
        filename=f"{batch.id}_{kind}.jsonl",
        chunks=_jsonl(lines),
    )


def _jsonl(lines) -> Iterator[bytes]:
    fields = ("request_id", "custom_id", "status_code", "result", "error")
    for request_id, custom_id, status_code, result, error in lines.values_list(*fields).iterator(
        chunk_size=500
    ):
        response = None
        if status_code is not None:
            response = {"status_code": status_code, "request_id": request_id, "body": result}
        line = {"id": request_id, "custom_id": custom_id, "response": response, "error": error}
        yield json.dumps(line, separators=(",", ":")).encode() + b"\n"
