"""ModelPrice: a model's price history (imported by inference/models.py, so it is one of the app's
models). inference/services/prices.py reads it: the price in force at a time, and what a
request's tokens cost at it."""

from django.db import models


class ModelPrice(models.Model):
    """What a model's tokens cost from `effective_from` on, until its next price: the history of
    its prices, in ORCHARD_CURRENCY per million tokens. A request is billed at the price in force
    when it started, and its cost is written on its usage row once; a price in force is never
    changed (a change is a new price from a later time), so no past cost is ever rewritten."""

    model = models.ForeignKey(
        "inference.ModelEntry", on_delete=models.CASCADE, related_name="prices"
    )
    effective_from = models.DateTimeField(help_text="From when this price applies (UTC).")
    input_per_million = models.DecimalField(
        "input", max_digits=14, decimal_places=6, help_text="Per million prompt tokens."
    )
    cached_input_per_million = models.DecimalField(
        "cached input",
        max_digits=14,
        decimal_places=6,
        null=True,
        blank=True,
        help_text="Per million prompt tokens served from the prefix cache. Empty: the input price.",
    )
    output_per_million = models.DecimalField(
        "output", max_digits=14, decimal_places=6, help_text="Per million completion tokens."
    )
    per_image = models.DecimalField(
        "per image",
        max_digits=14,
        decimal_places=9,
        default=0,
        help_text="Per input image, for models that take images.",
    )
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["model", "-effective_from"]
        verbose_name = "model price"
        constraints = [
            models.UniqueConstraint(fields=["model", "effective_from"], name="unique_model_price")
        ]

    def __str__(self) -> str:
        return f"{self.model} from {self.effective_from:%Y-%m-%d %H:%M}"
