"""Files and batches: the rows behind /v1/files and /v1/batches (imported by inference/models.py,
so they are the app's models).

A `StoredFile` is a team's upload (`purpose` "batch") or a batch's output or error file
("batch_output"); its bytes live under ORCHARD_FILES_DIR (inference/batches/files.py). A
`Batch` is a durable task row like a model pull (inference/pulls.py): one web process's runner
claims it (`runner`, renewing `heartbeat_at`; a row whose heartbeat is older than the lease is
taken over) and moves it through OpenAI's lifecycle. Each request line of its input file is a
`BatchLine`, written once when the batch is validated: the line's request and its state, and
once it has run, its answer (`result`), so that a batch resumed after a restart runs each line
once and bills it once (its usage row's request_id is the line's `request_id`).
"""

from django.db import models
from django.db.models import Q


class StoredFile(models.Model):
    class Purpose(models.TextChoices):
        BATCH = "batch"
        BATCH_OUTPUT = "batch_output"

    id = models.CharField(primary_key=True, max_length=40)
    team = models.ForeignKey("accounts.Team", on_delete=models.CASCADE, related_name="+")
    api_key = models.ForeignKey(
        "accounts.ApiKey", null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    purpose = models.CharField(max_length=20, choices=Purpose.choices)
    filename = models.CharField(max_length=255)
    num_bytes = models.PositiveBigIntegerField(default=0)
    sha256 = models.CharField(max_length=64, blank=True)
    created_at = models.DateTimeField(db_index=True)
    expires_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        indexes = [models.Index(fields=["team", "created_at"])]

    def __str__(self) -> str:
        return f"{self.id} ({self.filename})"


class Batch(models.Model):
    class Status(models.TextChoices):
        VALIDATING = "validating"
        FAILED = "failed"
        IN_PROGRESS = "in_progress"
        FINALIZING = "finalizing"
        COMPLETED = "completed"
        EXPIRED = "expired"
        CANCELLING = "cancelling"
        CANCELLED = "cancelled"

    # States a runner still has work in (to claim, resume, finish).
    ACTIVE_STATES = (Status.VALIDATING, Status.IN_PROGRESS, Status.FINALIZING, Status.CANCELLING)

    id = models.CharField(primary_key=True, max_length=40)
    team = models.ForeignKey("accounts.Team", on_delete=models.CASCADE, related_name="+")
    api_key = models.ForeignKey(
        "accounts.ApiKey", null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    endpoint = models.CharField(max_length=40)
    model = models.CharField(max_length=100, blank=True)
    completion_window = models.CharField(max_length=10, default="24h")
    status = models.CharField(max_length=12, choices=Status.choices, default=Status.VALIDATING)
    input_file = models.ForeignKey(
        StoredFile, null=True, on_delete=models.SET_NULL, related_name="+"
    )
    input_file_name = models.CharField(max_length=40)  # its id, kept once the file is deleted
    output_file = models.ForeignKey(
        StoredFile, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    error_file = models.ForeignKey(
        StoredFile, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    metadata = models.JSONField(null=True, blank=True)
    errors = models.JSONField(null=True, blank=True)  # [{code, message, param, line}]
    num_total = models.PositiveIntegerField(default=0)
    num_completed = models.PositiveIntegerField(default=0)
    num_failed = models.PositiveIntegerField(default=0)
    input_tokens = models.PositiveBigIntegerField(default=0)
    cached_tokens = models.PositiveBigIntegerField(default=0)
    output_tokens = models.PositiveBigIntegerField(default=0)
    stop_reason = models.TextField(blank=True)  # how a stopped batch is to end (services.py)
    runner = models.CharField(max_length=120, blank=True, help_text="host:pid:id of its runner.")
    attempts = models.PositiveSmallIntegerField(default=0)
    heartbeat_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(db_index=True)
    in_progress_at = models.DateTimeField(null=True, blank=True)
    expires_at = models.DateTimeField()
    finalizing_at = models.DateTimeField(null=True, blank=True)
    completed_at = models.DateTimeField(null=True, blank=True)
    failed_at = models.DateTimeField(null=True, blank=True)
    expired_at = models.DateTimeField(null=True, blank=True)
    cancelling_at = models.DateTimeField(null=True, blank=True)
    cancelled_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        verbose_name_plural = "batches"
        indexes = [
            models.Index(fields=["team", "created_at"]),
            models.Index(fields=["status", "heartbeat_at"]),
        ]

    def __str__(self) -> str:
        return self.id

    @property
    def active(self) -> bool:
        return self.status in self.ACTIVE_STATES


class BatchLine(models.Model):
    class State(models.TextChoices):
        PENDING = "pending"
        RUNNING = "running"
        DONE = "done"  # answered with a 2xx: a line of the output file
        FAILED = "failed"  # answered with an error: a line of the error file

    batch = models.ForeignKey(Batch, on_delete=models.CASCADE, related_name="lines")
    index = models.PositiveIntegerField()  # its line in the input file, from 0
    custom_id = models.CharField(max_length=512)
    request_id = models.CharField(max_length=64, unique=True)  # batch_req_…, its usage row's
    body = models.JSONField(null=True)  # the request's body; dropped once the line has ended
    state = models.CharField(max_length=8, choices=State.choices, default=State.PENDING)
    status_code = models.PositiveSmallIntegerField(null=True, blank=True)
    result = models.JSONField(null=True, blank=True)  # the response body (or its error)
    error = models.JSONField(null=True, blank=True)  # {code, message}: not run (expired, ...)
    attempts = models.PositiveSmallIntegerField(default=0)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["batch", "index"]
        constraints = [
            models.UniqueConstraint(fields=["batch", "index"], name="one_line_per_index"),
            models.UniqueConstraint(fields=["batch", "custom_id"], name="unique_custom_id"),
        ]
        indexes = [
            models.Index(
                fields=["batch", "index"],
                condition=Q(state="pending"),
                name="batch_line_pending",
            )
        ]

    def __str__(self) -> str:
        return f"{self.batch_id}:{self.index} ({self.custom_id})"
