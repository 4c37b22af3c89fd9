"""ModelPull: one pull of a model from the Hugging Face hub, a durable task row (imported by
inference/models.py, so it is one of the app's models).

The row is the task: what to pull (hub id, revision, registry name, kind, quantization), where
it stands (state, bytes or weights done of total, rate), who runs it (`runner`, renewing
`heartbeat_at` every second; a row whose heartbeat is older than the lease is taken over) and
how it ended (error, the registered model). inference/services/pulls/ runs and writes it.
"""

from django.conf import settings
from django.db import models
from django.db.models import Q


class ModelPull(models.Model):
    class State(models.TextChoices):
        QUEUED = "queued"
        DOWNLOADING = "downloading"
        CONVERTING = "converting"
        QUANTIZING = "quantizing"
        REGISTERING = "registering"
        DONE = "done"
        FAILED = "failed"
        CANCELLED = "cancelled"

    ACTIVE_STATES = (
        State.QUEUED,
        State.DOWNLOADING,
        State.CONVERTING,
        State.QUANTIZING,
        State.REGISTERING,
    )

    class Origin(models.TextChoices):
        ADMIN = "admin"
        SHELL = "shell"

    source = models.CharField(max_length=200, help_text="The hub id (org/name).")
    revision = models.CharField(
        max_length=200, blank=True, help_text="A branch, tag or commit; empty: main."
    )
    commit = models.CharField(max_length=64, blank=True, help_text="The revision resolved.")
    name = models.CharField(max_length=100, help_text="The name it is registered under.")
    kind = models.CharField(max_length=10, default="chat")
    quantize_bits = models.PositiveSmallIntegerField(null=True, blank=True)
    group_size = models.PositiveSmallIntegerField(default=64)
    state = models.CharField(max_length=12, choices=State.choices, default=State.QUEUED)
    done_bytes = models.PositiveBigIntegerField(default=0)
    total_bytes = models.PositiveBigIntegerField(null=True, blank=True)
    rate_bytes_per_s = models.FloatField(null=True, blank=True)
    error = models.TextField(blank=True)
    error_code = models.CharField(max_length=30, blank=True)
    cancel_requested = models.BooleanField(default=False)
    origin = models.CharField(max_length=5, choices=Origin.choices, default=Origin.ADMIN)
    started_by = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="+",
    )
    runner = models.CharField(max_length=120, blank=True, help_text="host:pid:id of its runner.")
    attempts = models.PositiveSmallIntegerField(default=0)
    heartbeat_at = models.DateTimeField(null=True, blank=True)
    model = models.ForeignKey(
        "inference.ModelEntry",
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="pulls",
    )
    created_at = models.DateTimeField(auto_now_add=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]
        indexes = [models.Index(fields=["state", "heartbeat_at"])]
        constraints = [
            # Two pulls into one name (or of one repo) would write the same folders.
            models.UniqueConstraint(
                fields=["name"],
                condition=Q(
                    state__in=["queued", "downloading", "converting", "quantizing", "registering"]
                ),
                name="one_active_pull_per_name",
            ),
            models.UniqueConstraint(
                fields=["source"],
                condition=Q(
                    state__in=["queued", "downloading", "converting", "quantizing", "registering"]
                ),
                name="one_active_pull_per_source",
            ),
        ]

    def __str__(self) -> str:
        revision = f"@{self.revision}" if self.revision else ""
        return f"{self.source}{revision} → {self.name}"

    @property
    def active(self) -> bool:
        return self.state in self.ACTIVE_STATES
