"""Prices and costs: the price in force for a model at a time (its history, `ModelPrice`), and what
a request's tokens cost at it.

A request is priced once, when admission finds its model (`Intake.model_entry`): that price
sizes a money budget's reservation (its dearest token and its images' price,
`Price.reservation_cost`) and is the one its usage row is billed at when it is finished, so the
limiter and the row always agree. Costs are whole nano-units of ORCHARD_CURRENCY
(common/money.py) per line item: uncached input, cached input, output. A model without a price
costs nothing.
"""

from __future__ import annotations

import datetime
import math
from dataclasses import dataclass
from decimal import ROUND_HALF_EVEN, Decimal

from common.money import NANOS_PER_UNIT
from inference.models import ModelPrice

# A price per million tokens is this many nano-units a token per unit of the price.
NANOS_PER_MILLION_TOKENS = Decimal(NANOS_PER_UNIT) / Decimal(10**6)


@dataclass(frozen=True)
class Cost:
    """A request's (or a day's) cost per line item, in nano-units."""

    input: int = 0
    cached_input: int = 0
    output: int = 0

    @property
    def total(self) -> int:
        return self.input + self.cached_input + self.output


@dataclass(frozen=True)
class Price:
    """A price as nano-units per token (per image for `image`)."""

    input: Decimal = Decimal(0)
    cached_input: Decimal = Decimal(0)
    output: Decimal = Decimal(0)
    image: Decimal = Decimal(0)

    @classmethod
    def of(cls, row: ModelPrice | None) -> Price:
        if row is None:
            return FREE
        cached = row.cached_input_per_million
        return cls(
            input=row.input_per_million * NANOS_PER_MILLION_TOKENS,
            cached_input=(row.input_per_million if cached is None else cached)
            * NANOS_PER_MILLION_TOKENS,
            output=row.output_per_million * NANOS_PER_MILLION_TOKENS,
            image=row.per_image * NANOS_PER_UNIT,
        )

    @property
    def token_cost(self) -> int:
        """The most one token may cost (nano-units, rounded up): what a money budget reserves
        per token of a request, an upper bound of what the request can cost."""
        return math.ceil(max(self.input, self.cached_input, self.output))

    def reservation_cost(self, tokens: int, images: int = 0) -> int:
        """What a money budget reserves per token of a request of at least `tokens` tokens
        with `images` images: the dearest token, plus the images' price spread over those
        tokens (rounded up), so that what the request can cost never passes its reservation."""
        extra = images * self.image
        return self.token_cost + (math.ceil(extra / max(1, tokens)) if extra > 0 else 0)

    def cost(
        self, *, prompt_tokens: int, cached_tokens: int, completion_tokens: int, images: int = 0
    ) -> Cost:
        """What the tokens cost: `prompt_tokens` includes the `cached_tokens` (OpenAI's
        counting), which are priced as cached input; images count as input."""
        cached = min(max(0, cached_tokens), max(0, prompt_tokens))
        return Cost(
            input=_nanos((prompt_tokens - cached) * self.input + images * self.image),
            cached_input=_nanos(cached * self.cached_input),
            output=_nanos(max(0, completion_tokens) * self.output),
        )


FREE = Price()


def _nanos(value: Decimal) -> int:
    return int(value.to_integral_value(rounding=ROUND_HALF_EVEN))


def price_at(*, model: str, at: datetime.datetime) -> Price:
    """The price of the model named `model` in force at `at` (FREE when it has none)."""
    row = (
        ModelPrice.objects.filter(model__name=model, effective_from__lte=at)
        .order_by("-effective_from")
        .first()
    )
    return Price.of(row)
