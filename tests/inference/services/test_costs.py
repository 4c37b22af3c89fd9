"""Prices and costs: a model's price history (a change applies from its time and never rewrites a
past cost), each usage row's cost per line item at the price its request started under, the
daily roll-ups and reports summing it, and the admin's rules for prices (history is never
edited)."""

import datetime
from decimal import Decimal

import pytest
from django.db.models import Sum
from django.forms import inlineformset_factory
from django.utils import timezone

from inference.admin.prices import (
    ERROR_IN_THE_PAST,
    ModelPriceForm,
    ModelPriceFormSet,
)
from inference.models import DailyUsage, ModelEntry, ModelPrice, UsageRecord
from inference.services import reports
from inference.services.prices import FREE, Price, price_at
from inference.services.usage import usage_close_stale, usage_finish, usage_open
from tests.factories import ApiKeyFactory, ModelEntryFactory

pytestmark = pytest.mark.django_db
NOW = timezone.now()


def priced(entry, *, start, input="1.000", cached=None, output="2.000"):
    return ModelPrice.objects.create(
        model=entry,
        effective_from=start,
        input_per_million=Decimal(input),
        cached_input_per_million=None if cached is None else Decimal(cached),
        output_per_million=Decimal(output),
    )


def finished(api_key, model, *, started_at, prompt, cached=0, completion, price=None, rid=None):
    record = usage_open(
        request_id=rid or f"r-{started_at.timestamp()}-{prompt}-{completion}",
        api_key=api_key,
        model=model,
        endpoint="chat.completions",
    )
    UsageRecord.objects.filter(pk=record.pk).update(started_at=started_at)
    usage_finish(
        record_id=record.pk,
        status="completed",
        prompt_tokens=prompt,
        cached_tokens=cached,
        completion_tokens=completion,
        price=price,
    )
    return UsageRecord.objects.get(pk=record.pk)


def test_a_price_per_million_is_exact_in_nano_units_per_line_item():
    entry = ModelEntryFactory(name="m")
    row = priced(entry, start=NOW, input="0.150", cached="0.075", output="0.600")
    price = Price.of(row)
    cost = price.cost(prompt_tokens=1000, cached_tokens=400, completion_tokens=250)
    # 600 uncached × 150 nano-units, 400 cached × 75, 250 out × 600
    assert (cost.input, cost.cached_input, cost.output) == (90_000, 30_000, 150_000)
    assert cost.total == 270_000
    assert price.token_cost == 600  # the dearest token: what a money budget reserves per token
    # Finer prices round per row and line item (half to even), never per token.
    fine = Price.of(priced(entry, start=NOW + datetime.timedelta(1), input="0.0015", output="0"))
    assert fine.cost(prompt_tokens=3, cached_tokens=0, completion_tokens=0).input == 4  # 4.5
    assert fine.token_cost == 2  # rounded up: an upper bound
    assert FREE.cost(prompt_tokens=10**6, cached_tokens=0, completion_tokens=10**6).total == 0


def test_cached_input_defaults_to_the_input_price():
    price = Price.of(priced(ModelEntryFactory(name="m"), start=NOW, input="3", output="15"))
    cost = price.cost(prompt_tokens=10, cached_tokens=10, completion_tokens=0)
    assert cost.cached_input == 30_000 and cost.input == 0


def test_a_price_change_mid_period_keeps_older_rows_costs():
    api_key = ApiKeyFactory()
    entry = ModelEntryFactory(name="m")
    first = NOW - datetime.timedelta(hours=3)
    change = NOW - datetime.timedelta(hours=1)
    priced(entry, start=first, input="1", output="2")
    before = finished(
        api_key, "m", started_at=first + datetime.timedelta(minutes=5), prompt=1000, completion=500
    )
    assert before.cost == 1000 * 1000 + 500 * 2000
    # A new price from `change` on: rows that started before keep their cost, even one finished
    # after the change (it is billed at the price its request started under).
    priced(entry, start=change, input="10", output="20")
    straddling = finished(
        api_key, "m", started_at=change - datetime.timedelta(seconds=1), prompt=1000, completion=500
    )
    after = finished(
        api_key, "m", started_at=change + datetime.timedelta(minutes=1), prompt=1000, completion=500
    )
    assert UsageRecord.objects.get(pk=before.pk).cost == 2_000_000
    assert straddling.cost == 2_000_000
    assert after.cost == 20_000_000
    assert price_at(model="m", at=first - datetime.timedelta(seconds=1)) == FREE
    assert price_at(model="m", at=change) == Price.of(ModelPrice.objects.get(effective_from=change))


def test_a_row_is_billed_at_the_price_it_was_admitted_at():
    """The settlement passes the price admission read; the row records exactly that."""
    api_key = ApiKeyFactory()
    entry = ModelEntryFactory(name="m")
    admitted_at = Price.of(priced(entry, start=NOW - datetime.timedelta(hours=1), input="5"))
    priced(entry, start=NOW - datetime.timedelta(minutes=1), input="50")
    row = finished(api_key, "m", started_at=NOW, prompt=100, completion=0, price=admitted_at)
    assert row.input_cost == 100 * 5000


def test_roll_ups_sum_the_rows_costs_and_the_reports_read_them():
    key, other_key = ApiKeyFactory(), ApiKeyFactory()
    entry = ModelEntryFactory(name="m")
    priced(entry, start=NOW - datetime.timedelta(days=1), input="1", cached="0.5", output="4")
    rows = [
        finished(key, "m", started_at=NOW, prompt=100, cached=40, completion=10),
        finished(key, "m", started_at=NOW, prompt=7, completion=3),
        finished(other_key, "m", started_at=NOW, prompt=1, completion=1),
    ]
    daily = DailyUsage.objects.get(api_key=key)
    assert daily.input_cost == 60 * 1000 + 7 * 1000
    assert daily.cached_input_cost == 40 * 500
    assert daily.output_cost == 13 * 4000
    mine = reports.daily_rows(since=NOW.date(), until=NOW.date(), teams=[key.team])
    assert reports.totals(mine)["cost"] == rows[0].cost + rows[1].cost
    everything = reports.daily_rows(since=NOW.date(), until=NOW.date())
    by_row = UsageRecord.objects.aggregate(
        n=Sum("input_cost") + Sum("cached_input_cost") + Sum("output_cost")
    )["n"]
    assert reports.totals(everything)["cost"] == by_row
    [(model, tokens, cost)] = reports.report(mine, ["day"]).by_model
    assert (model, tokens, cost) == ("m", 120, rows[0].cost + rows[1].cost)


def test_a_swept_row_is_billed_for_its_tokens_and_a_late_finish_corrects_it():
    api_key = ApiKeyFactory()
    priced(ModelEntryFactory(name="m"), start=NOW - datetime.timedelta(days=1), input="1")
    record = usage_open(request_id="stale", api_key=api_key, model="m", endpoint="x")
    UsageRecord.objects.filter(pk=record.pk).update(
        started_at=NOW - datetime.timedelta(hours=2), prompt_tokens=50
    )
    assert usage_close_stale(older_than=datetime.timedelta(hours=1)) == 1
    assert DailyUsage.objects.get().input_cost == 50_000
    usage_finish(record_id=record.pk, status="completed", prompt_tokens=80, completion_tokens=0)
    assert DailyUsage.objects.get().input_cost == 80_000  # replaced, not added


def test_a_new_price_starts_now_or_later_never_in_the_past():
    entry = ModelEntryFactory(name="m")
    now_form = ModelPriceForm(
        {"input_per_million": "1", "output_per_million": "2", "per_image": "0"},
        instance=ModelPrice(model=entry),
    )
    assert now_form.is_valid(), now_form.errors
    assert now_form.cleaned_data["effective_from"] <= timezone.now()
    past = timezone.now() - datetime.timedelta(minutes=5)
    form = ModelPriceForm(
        {
            "effective_from": past.strftime("%Y-%m-%d %H:%M:%S"),
            "input_per_million": "1",
            "output_per_million": "2",
            "per_image": "0",
        },
        instance=ModelPrice(model=entry),
    )
    assert not form.is_valid()
    assert form.errors["effective_from"] == [ERROR_IN_THE_PAST]


def test_a_price_in_force_is_never_changed_or_deleted_but_a_future_one_may_be():
    entry = ModelEntryFactory(name="m")
    in_force = priced(entry, start=NOW - datetime.timedelta(days=1))
    future = priced(entry, start=NOW + datetime.timedelta(days=1))

    def edit(price, output):
        return ModelPriceForm(
            {
                "effective_from": price.effective_from.strftime("%Y-%m-%d %H:%M:%S"),
                "input_per_million": "1",
                "output_per_million": output,
                "per_image": "0",
            },
            instance=price,
        )

    assert not edit(in_force, "3").is_valid()
    assert edit(future, "3").is_valid()
    formset_class = inlineformset_factory(
        ModelEntry, ModelPrice, form=ModelPriceForm, formset=ModelPriceFormSet, extra=0
    )
    prefix = "prices"
    data = {
        f"{prefix}-TOTAL_FORMS": "2",
        f"{prefix}-INITIAL_FORMS": "2",
        f"{prefix}-MIN_NUM_FORMS": "0",
        f"{prefix}-MAX_NUM_FORMS": "1000",
    }
    for index, price in enumerate(ModelPrice.objects.filter(model=entry).order_by("pk")):
        data.update(
            {
                f"{prefix}-{index}-id": str(price.pk),
                f"{prefix}-{index}-model": str(entry.pk),
                f"{prefix}-{index}-effective_from": price.effective_from.strftime(
                    "%Y-%m-%d %H:%M:%S"
                ),
                f"{prefix}-{index}-input_per_million": "1",
                f"{prefix}-{index}-output_per_million": "2",
                f"{prefix}-{index}-per_image": "0",
            }
        )
    deleting_past = {**data, f"{prefix}-0-DELETE": "on"}
    assert not formset_class(deleting_past, instance=entry, prefix=prefix).is_valid()
    deleting_future = {**data, f"{prefix}-1-DELETE": "on"}
    assert formset_class(deleting_future, instance=entry, prefix=prefix).is_valid()
