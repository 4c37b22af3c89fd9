from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models

from engine import SERVICE_TIERS, InvalidRequestError, SamplingParams
from inference.parsers.registry import reasoning_parser_choices, tool_parser_choices

ERROR_DEFAULT_MUST_BE_ENABLED = (
    "The default model must stay enabled; make another model the default first."
)

ERROR_DEFAULT_OVER_CEILING = "The default cannot be over the output token ceiling ({:,})."

# The sampling fields a registry entry may preset (used when a request omits them), with types.
SAMPLING_DEFAULT_FIELDS = {
    "temperature": float,
    "top_p": float,
    "top_k": int,
    "min_p": float,
    "presence_penalty": float,
    "frequency_penalty": float,
    "repetition_penalty": float,
}
# The tier a request was served in (engine.SERVICE_TIERS; requests without one, embeddings and
# refusals, count as default).
SERVICE_TIER_CHOICES = [(tier, tier) for tier in SERVICE_TIERS]


class ModelEntry(models.Model):
    """A model the registry serves: an mlx-lm model folder and how to run it."""

    class Engine(models.TextChoices):
        BATCHED = "batched", "Batched (continuous batching)"
        SIMPLE = "simple", "Simple (serialized)"

    class Kind(models.TextChoices):
        CHAT = "chat", "Chat / completions (mlx-lm)"
        EMBEDDING = "embedding", "Embeddings (a sentence-transformers encoder)"

    name = models.CharField(max_length=100, unique=True)
    kind = models.CharField(max_length=10, choices=Kind.choices, default=Kind.CHAT)
    path = models.CharField(
        max_length=500, help_text="mlx-lm model folder (a sentence-transformers one for embeddings)"
    )
    engine = models.CharField(max_length=10, choices=Engine.choices, default=Engine.BATCHED)
    enabled = models.BooleanField(default=True)
    is_default = models.BooleanField(default=False)
    tool_parser = models.CharField(
        max_length=50,
        blank=True,
        choices=tool_parser_choices,
        help_text="How tool calls are read from replies. Empty: detected from the chat template.",
    )
    reasoning_parser = models.CharField(
        max_length=50,
        blank=True,
        choices=reasoning_parser_choices,
        help_text="How reasoning is split from replies. Empty: detected from the chat template.",
    )
    context_length = models.PositiveIntegerField(
        null=True, blank=True, help_text="Empty: the model's own maximum."
    )
    default_sampling = models.JSONField(
        default=dict, blank=True, help_text='Defaults for omitted fields, e.g. {"temperature": 0.7}'
    )
    default_max_tokens = models.PositiveIntegerField(
        "default output tokens",
        null=True,
        blank=True,
        validators=[MinValueValidator(1)],
        help_text="The most a reply may generate when a request leaves max_tokens unset. "
        "Empty: the rest of the context (up to the ceiling), which lets a small model that "
        "repeats itself run for minutes.",
    )
    max_output_tokens = models.PositiveIntegerField(
        "output token ceiling",
        null=True,
        blank=True,
        validators=[MinValueValidator(1)],
        help_text="The most a request may ask for (max_tokens and its aliases); more is a 400 "
        "naming this ceiling. Empty: the context is the only limit.",
    )
    max_num_seqs = models.PositiveIntegerField(
        default=64,
        help_text="Sequences decoding together. Admission also waits for memory, so a large "
        "value is safe; more rows a step is more tokens/s (bench/RESULTS.md).",
    )
    max_num_batched_tokens = models.PositiveIntegerField(default=2048)
    max_waiting = models.PositiveIntegerField(default=256)
    prefill_chunk_tokens = models.PositiveIntegerField(
        null=True,
        blank=True,
        help_text="Prompt tokens per step while other requests are generating. Empty: sized "
        "from the measured prefill speed, so running streams keep flowing.",
    )
    memory_budget_bytes = models.PositiveBigIntegerField(
        null=True,
        blank=True,
        help_text="Bytes for the running requests' caches and the prefix cache together. "
        "Empty: 60% of the device's memory less the weights.",
    )
    speculative_tokens = models.PositiveSmallIntegerField(
        default=4,
        validators=[MaxValueValidator(16)],
        help_text="Speculative decoding: the longest draft a step checks per sequence, taken "
        "from the draft model if one is set, else from the sequence's own earlier tokens "
        "(agents and edits repeat their input). Greedy and seeded outputs are unchanged; "
        "small batches only. 0: off.",
    )
    draft_model = models.ForeignKey(
        "self",
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="drafts_for",
        limit_choices_to={"kind": "chat"},
        help_text="A smaller model of the same family (the same tokenizer) whose guesses of the "
        "next tokens this model checks in one step. Empty: guesses by prompt lookup.",
    )
    prefix_cache_bytes = models.PositiveBigIntegerField(
        null=True,
        blank=True,
        help_text="The prefix cache's share of the memory budget. Empty: a quarter; 0: off.",
    )
    kv_cache_bits = models.PositiveSmallIntegerField(
        "KV cache bits",
        null=True,
        blank=True,
        choices=[(8, "8 bits"), (4, "4 bits")],
        help_text="Keep the attention keys and values quantized: about half (8 bits) or a "
        "quarter (4 bits) of the memory per token at 16-bit precision, so more streams fit; "
        "the quality cost is measured in bench/RESULTS.md. Empty: the model's own precision. "
        "Changing it reloads the model.",
    )
    kv_cache_group_size = models.PositiveSmallIntegerField(
        "KV cache group size",
        default=64,
        choices=[(32, "32"), (64, "64"), (128, "128")],
        help_text="Elements per quantization group along each head (it must divide the "
        "model's head size). Smaller groups: more accurate, a little more memory.",
    )
    prefix_cache_shared = models.BooleanField(
        default=False,
        help_text="Share cached prompt prefixes across teams. Off: each team hits only its own "
        "(another team can neither reuse nor time them).",
    )
    source = models.CharField(
        max_length=200,
        blank=True,
        help_text="The Hugging Face hub id the model was pulled from (org/name). Empty: a "
        "local folder.",
    )
    source_revision = models.CharField(
        max_length=100, blank=True, help_text="The hub commit the files were downloaded at."
    )
    quantization_bits = models.PositiveSmallIntegerField(
        null=True, blank=True, help_text="Bits per weight when Orchard quantized it (4 or 8)."
    )
    quantization_group_size = models.PositiveSmallIntegerField(null=True, blank=True)
    size_on_disk_bytes = models.PositiveBigIntegerField(
        null=True, blank=True, help_text="The model folder's size when it was registered."
    )
    pinned = models.BooleanField(
        default=False,
        help_text="Keep it loaded: never unloaded after idling, nor to make room for another "
        "model in the memory budget.",
    )
    idle_unload_seconds = models.PositiveIntegerField(
        null=True,
        blank=True,
        help_text="Unload it after this many seconds without requests. Empty: the server's "
        "default (ORCHARD_MODEL_IDLE_SECONDS); 0: never.",
    )
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name"]
        verbose_name = "model"
        constraints = [
            models.UniqueConstraint(
                fields=["is_default"],
                condition=models.Q(is_default=True),
                name="one_default_model",
            )
        ]

    def __str__(self) -> str:
        return self.name

    def clean(self) -> None:
        """Defaults must be values a request could have sent: a bad one would otherwise fail
        every request that omits the field, with an error blaming the caller."""
        if self.is_default and not self.enabled:
            raise ValidationError({"enabled": ERROR_DEFAULT_MUST_BE_ENABLED})
        if self.is_default and self.kind != self.Kind.CHAT:
            raise ValidationError({"is_default": "The default model must be a chat model."})
        if self.draft_model_id is not None:
            draft = self.draft_model
            if self.kind != self.Kind.CHAT:
                raise ValidationError({"draft_model": "Only chat models take a draft model."})
            if draft.pk == self.pk:
                raise ValidationError({"draft_model": "A model cannot be its own draft model."})
            if draft.kind != self.Kind.CHAT:
                raise ValidationError({"draft_model": "The draft model must be a chat model."})
        if (
            self.default_max_tokens is not None
            and self.max_output_tokens is not None
            and self.default_max_tokens > self.max_output_tokens
        ):
            raise ValidationError(
                {"default_max_tokens": ERROR_DEFAULT_OVER_CEILING.format(self.max_output_tokens)}
            )
        defaults = self.default_sampling
        if not isinstance(defaults, dict):
            raise ValidationError({"default_sampling": "Must be a JSON object."})
        for name, value in defaults.items():
            kind = SAMPLING_DEFAULT_FIELDS.get(name)
            if kind is None:
                allowed = ", ".join(SAMPLING_DEFAULT_FIELDS)
                raise ValidationError({"default_sampling": f"Unknown field {name!r}: {allowed}."})
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or (kind is int and not float(value).is_integer())
            ):
                raise ValidationError(
                    {"default_sampling": f"{name} must be a {kind.__name__}, not {value!r}."}
                )
        try:
            SamplingParams(
                **{k: SAMPLING_DEFAULT_FIELDS[k](v) for k, v in defaults.items()}
            ).validate()
        except InvalidRequestError as exc:
            raise ValidationError({"default_sampling": str(exc)}) from None


class UsageRecord(models.Model):
    """One row per API request, opened at admission and finished exactly once."""

    class Status(models.TextChoices):
        IN_PROGRESS = "in_progress"
        COMPLETED = "completed"
        CANCELLED = "cancelled"
        FAILED = "failed"
        REJECTED = "rejected"

    request_id = models.CharField(max_length=64, unique=True)
    api_key = models.ForeignKey(
        "accounts.ApiKey", on_delete=models.PROTECT, related_name="usage_records"
    )
    team = models.ForeignKey("accounts.Team", on_delete=models.PROTECT, related_name="+")
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="+")
    model = models.CharField(max_length=100)
    endpoint = models.CharField(max_length=50)
    service_tier = models.CharField(max_length=10, choices=SERVICE_TIER_CHOICES, default="default")
    # A line of a batch (/v1/batches): the batch's id; batch work is reported apart.
    batch_id = models.CharField(max_length=40, blank=True, db_index=True)
    status = models.CharField(max_length=12, choices=Status.choices, default=Status.IN_PROGRESS)
    error_code = models.CharField(max_length=50, blank=True)
    prompt_tokens = models.PositiveIntegerField(default=0)
    cached_tokens = models.PositiveIntegerField(default=0)
    completion_tokens = models.PositiveIntegerField(default=0)
    images = models.PositiveIntegerField(default=0)  # input images (priced per image)
    reserved_tokens = models.PositiveIntegerField(default=0)
    # What the request cost, per line item, in nano-units of ORCHARD_CURRENCY (common/money.py),
    # at its model's price when it started; written when it is finished, never changed after.
    input_cost = models.BigIntegerField(default=0)
    cached_input_cost = models.BigIntegerField(default=0)
    output_cost = models.BigIntegerField(default=0)
    time_to_first_token_ms = models.PositiveIntegerField(null=True, blank=True)
    duration_ms = models.PositiveIntegerField(null=True, blank=True)
    started_at = models.DateTimeField(db_index=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-started_at"]
        indexes = [
            models.Index(fields=["team", "started_at"]),
            models.Index(fields=["api_key", "started_at"]),
            models.Index(fields=["status"]),
        ]

    def __str__(self) -> str:
        return f"{self.request_id} {self.model} {self.status}"

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    @property
    def cost(self) -> int:
        return self.input_cost + self.cached_input_cost + self.output_cost


class DailyUsage(models.Model):
    """Roll-up of finished usage rows by day × team × key × model × service tier; reports read
    these."""

    date = models.DateField()
    team = models.ForeignKey("accounts.Team", on_delete=models.PROTECT, related_name="+")
    api_key = models.ForeignKey("accounts.ApiKey", on_delete=models.PROTECT, related_name="+")
    model = models.CharField(max_length=100)
    service_tier = models.CharField(max_length=10, choices=SERVICE_TIER_CHOICES, default="default")
    batch = models.BooleanField(default=False)  # the rows of batch lines (UsageRecord.batch_id)
    num_requests = models.PositiveIntegerField(default=0)
    num_completed = models.PositiveIntegerField(default=0)
    num_cancelled = models.PositiveIntegerField(default=0)
    num_failed = models.PositiveIntegerField(default=0)
    num_rejected = models.PositiveIntegerField(default=0)
    prompt_tokens = models.PositiveBigIntegerField(default=0)
    cached_tokens = models.PositiveBigIntegerField(default=0)
    completion_tokens = models.PositiveBigIntegerField(default=0)
    images = models.PositiveBigIntegerField(default=0)
    input_cost = models.BigIntegerField(default=0)  # nano-units, as on the usage rows
    cached_input_cost = models.BigIntegerField(default=0)
    output_cost = models.BigIntegerField(default=0)

    class Meta:
        ordering = ["-date"]
        verbose_name_plural = "daily usage"
        constraints = [
            models.UniqueConstraint(
                fields=["date", "team", "api_key", "model", "service_tier", "batch"],
                name="unique_daily_usage_batch",
            )
        ]
        indexes = [models.Index(fields=["team", "date"])]

    def __str__(self) -> str:
        return f"{self.date} {self.model}"


class StoredResponse(models.Model):
    """A /v1/responses response kept for its team (`store`, the default): what GET returns, and
    the conversation a later request continues with `previous_response_id`.

    Every item is stored once, in the row of the response that brought it: `body` is the
    response object as the client received it (its `output` items included), `new_input_items`
    only the input items the response added. A response that continues another points to it
    (`continues`); what it answered is the continued response's input items and output, less
    the `num_dropped` items from `drop_start` that truncation "auto" dropped, then its own new
    input items. Reading a chain is one recursive query up the `continues` links and one pass
    down them (inference/services/stored_responses.py), so a chain of n responses stores O(n)
    bytes and reads in O(its length), where a copy of the conversation in every row grew as
    O(n²).

    Deleting a response that another one continues only hides it (`deleted_at`; its body
    trimmed to the output the continuation replays): the chain stays continuable. A hidden
    response goes once nothing continues it any more. `num_bytes` is what the row counts
    against its team's storage quota (`TeamResponseStorage`)."""

    class Status(models.TextChoices):
        COMPLETED = "completed"
        INCOMPLETE = "incomplete"
        FAILED = "failed"
        CANCELLED = "cancelled"

    id = models.CharField(primary_key=True, max_length=64)
    team = models.ForeignKey("accounts.Team", on_delete=models.CASCADE, related_name="+")
    api_key = models.ForeignKey(
        "accounts.ApiKey", on_delete=models.SET_NULL, null=True, related_name="+"
    )
    model = models.CharField(max_length=100)
    status = models.CharField(max_length=12, choices=Status.choices)
    previous_response_id = models.CharField(max_length=64, blank=True)
    # RESTRICT: a response is never deleted under one that continues it (a team's deletion,
    # which takes both, still may).
    continues = models.ForeignKey(
        "self", on_delete=models.RESTRICT, null=True, blank=True, related_name="continuations"
    )
    drop_start = models.PositiveIntegerField(default=0)
    num_dropped = models.PositiveIntegerField(default=0)
    body = models.JSONField()
    new_input_items = models.JSONField(default=list)
    num_bytes = models.PositiveBigIntegerField(default=0)
    created_at = models.DateTimeField(db_index=True)
    deleted_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]
        verbose_name = "stored response"
        indexes = [models.Index(fields=["team", "created_at"])]

    def __str__(self) -> str:
        return self.id


class TeamResponseStorage(models.Model):
    """The bytes of a team's stored responses (the sum of their `num_bytes`), kept up to date
    as they are stored and deleted, so the quota check reads one row."""

    team = models.OneToOneField(
        "accounts.Team",
        on_delete=models.CASCADE,
        primary_key=True,
        related_name="response_storage",
    )
    num_bytes = models.BigIntegerField(default=0)

    class Meta:
        verbose_name = "team response storage"

    def __str__(self) -> str:
        return f"{self.team_id}: {self.num_bytes} bytes"


# Files and batches (/v1/files, /v1/batches), in a module of their own (inference/batch_models.py);
# imported here so that they are the app's models.
from inference.batch_models import Batch, BatchLine, StoredFile  # noqa: E402, F401

# A model's price history, in a module of its own (inference/prices.py); imported here so that
# it is one of the app's models.
from inference.prices import ModelPrice  # noqa: E402, F401

# A pull from the hub, kept in a module of its own (inference/pulls.py); imported here so that
# it is one of the app's models.
from inference.pulls import ModelPull  # noqa: E402, F401
