"""Money as Orchard counts it: whole nano-units (10^-9) of the one configured currency
(ORCHARD_CURRENCY), kept in integer columns and counters so that sums are exact on every
database and in Redis; Decimal at the edges (prices typed in the admin, amounts shown and sent).

A price of 0.001 per million tokens is one nano-unit a token, so a token at any price an admin
types with three decimals costs a whole number of nano-units; finer prices are rounded per usage
row and line item (half to even), never per token."""

from __future__ import annotations

from decimal import ROUND_HALF_EVEN, Decimal

from django.conf import settings

NANOS_PER_UNIT = 10**9
NANO = Decimal(1).scaleb(-9)
# The most money one budget or counter may hold: Redis' Lua counts in doubles, exact below 2^53
# nano-units.
MAX_NANOS = 2**53


def currency() -> str:
    """The configured currency, as ISO 4217 writes it (upper case)."""
    return settings.ORCHARD_CURRENCY


def to_nanos(amount: Decimal | int | str) -> int:
    """A money amount in nano-units, rounded half to even."""
    return int((Decimal(amount) * NANOS_PER_UNIT).to_integral_value(rounding=ROUND_HALF_EVEN))


def from_nanos(nanos: int | None) -> Decimal:
    """Nano-units as an exact Decimal of the currency (trailing zeros dropped, at least two
    decimals)."""
    value = (Decimal(nanos or 0) * NANO).normalize()
    return value.quantize(Decimal("0.01")) if -value.as_tuple().exponent < 2 else value


def format_money(nanos: int | None, *, with_currency: bool = True) -> str:
    """For pages and messages: "12.50 USD", "0.000123 USD" (two decimals, more where an amount
    under one needs them, at most four for larger ones), thousands separated. Integer
    arithmetic: the reports format thousands of these a page."""
    nanos = int(nanos or 0)
    units, fraction = divmod(abs(nanos), NANOS_PER_UNIT)
    if units:
        # Rounded to 1/10,000, half to even.
        tenths, rest = divmod(fraction, 10**5)
        if rest > 5 * 10**4 or (rest == 5 * 10**4 and tenths % 2):
            tenths += 1
        units, tenths = units + tenths // 10**4, tenths % 10**4
        digits = f"{tenths:04d}".rstrip("0")
    else:
        digits = f"{fraction:09d}".rstrip("0")
    text = f"{'-' if nanos < 0 else ''}{units:,}.{digits.ljust(2, '0')}"
    return f"{text} {currency()}" if with_currency else text
