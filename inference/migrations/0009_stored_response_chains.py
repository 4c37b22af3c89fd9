"""Stored responses keep only what they added and point to the response they continue
(inference/models.py, `StoredResponse`), instead of a copy of the whole conversation each.

The conversion reads the old rows' `input_items` (the whole conversation a response answered)
and, where the response it continued (`previous_response_id`, same team) is still stored, keeps
only what follows that one's conversation, with the range truncation dropped from it; other
rows keep their whole input as their own. Then it counts each team's bytes. Reversible: going
back writes every response's whole input again and drops the hidden rows."""

import json

import django.db.models.deletion
from django.db import migrations, models

BATCH_SIZE = 200


def json_num_bytes(value):
    return len(json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode())


def split_continued(previous, items):
    """How `items` (what a response answered) continues `previous` (what the response it
    continued answered, then its output): (drop_start, num_dropped, num_new) with
    items == previous[:drop_start] + previous[drop_start + num_dropped:] + its last num_new
    items; None when it shares nothing with `previous`."""
    shared = 0
    while shared < min(len(previous), len(items)) and previous[shared] == items[shared]:
        shared += 1
    if shared == len(previous):
        return 0, 0, len(items) - shared
    rest = items[shared:]
    for num_dropped in range(1, len(previous) - shared + 1):
        kept = previous[shared + num_dropped :]
        if rest[: len(kept)] == kept:
            if shared == 0 and not kept:
                return None
            return shared, num_dropped, len(rest) - len(kept)
    return None


def _batches(queryset):
    last = None
    while True:
        batch = queryset.order_by("pk")
        if last is not None:
            batch = batch.filter(pk__gt=last)
        batch = list(batch[:BATCH_SIZE])
        if not batch:
            return
        yield batch
        last = batch[-1].pk


def _check_constraints_now(schema_editor):
    # PostgreSQL refuses to alter a table with deferred foreign-key checks still pending in the
    # transaction (the column removed after the conversion, or before it going back).
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute("SET CONSTRAINTS ALL IMMEDIATE")


def to_chains(apps, schema_editor):
    StoredResponse = apps.get_model("inference", "StoredResponse")
    TeamResponseStorage = apps.get_model("inference", "TeamResponseStorage")
    fields = ["continues", "drop_start", "num_dropped", "new_input_items", "num_bytes"]
    totals = {}
    for batch in _batches(StoredResponse.objects.all()):
        for stored in batch:
            stored.new_input_items = stored.input_items
            previous = None
            if stored.previous_response_id:
                previous = (
                    StoredResponse.objects.filter(
                        pk=stored.previous_response_id, team_id=stored.team_id
                    )
                    .values("input_items", "body")
                    .first()
                )
            if previous is not None:
                continued = [*previous["input_items"], *previous["body"].get("output", [])]
                split = split_continued(continued, stored.input_items)
                if split is not None:
                    stored.continues_id = stored.previous_response_id
                    stored.drop_start, stored.num_dropped, num_new = split
                    tail = len(stored.input_items) - num_new
                    stored.new_input_items = stored.input_items[tail:]
            stored.num_bytes = json_num_bytes(stored.body) + json_num_bytes(stored.new_input_items)
            totals[stored.team_id] = totals.get(stored.team_id, 0) + stored.num_bytes
        StoredResponse.objects.bulk_update(batch, fields)
    TeamResponseStorage.objects.bulk_create(
        TeamResponseStorage(team_id=team_id, num_bytes=num_bytes)
        for team_id, num_bytes in totals.items()
    )
    _check_constraints_now(schema_editor)


def _answered(StoredResponse, stored):
    chain = [stored]
    while chain[-1].continues_id is not None:
        chain.append(StoredResponse.objects.get(pk=chain[-1].continues_id))
    items = []
    for row in reversed(chain):
        if row.num_dropped:
            items = items[: row.drop_start] + items[row.drop_start + row.num_dropped :]
        items += row.new_input_items
        if row is not stored:
            items += row.body.get("output", [])
    return items


def to_copies(apps, schema_editor):
    StoredResponse = apps.get_model("inference", "StoredResponse")
    for batch in _batches(StoredResponse.objects.filter(deleted_at__isnull=True)):
        for stored in batch:
            stored.input_items = _answered(StoredResponse, stored)
        StoredResponse.objects.bulk_update(batch, ["input_items"])
    StoredResponse.objects.update(continues=None)
    StoredResponse.objects.filter(deleted_at__isnull=False).delete()
    _check_constraints_now(schema_editor)


class Migration(migrations.Migration):
    dependencies = [
        ("accounts", "0004_team_member_keys_and_usage_readers"),
        ("inference", "0008_prefix_cache_shared"),
    ]

    operations = [
        migrations.CreateModel(
            name="TeamResponseStorage",
            fields=[
                (
                    "team",
                    models.OneToOneField(
                        on_delete=django.db.models.deletion.CASCADE,
                        primary_key=True,
                        related_name="response_storage",
                        serialize=False,
                        to="accounts.team",
                    ),
                ),
                ("num_bytes", models.BigIntegerField(default=0)),
            ],
            options={
                "verbose_name": "team response storage",
            },
        ),
        migrations.AddField(
            model_name="storedresponse",
            name="continues",
            field=models.ForeignKey(
                blank=True,
                null=True,
                on_delete=django.db.models.deletion.RESTRICT,
                related_name="continuations",
                to="inference.storedresponse",
            ),
        ),
        migrations.AddField(
            model_name="storedresponse",
            name="drop_start",
            field=models.PositiveIntegerField(default=0),
        ),
        migrations.AddField(
            model_name="storedresponse",
            name="num_dropped",
            field=models.PositiveIntegerField(default=0),
        ),
        migrations.AddField(
            model_name="storedresponse",
            name="new_input_items",
            field=models.JSONField(default=list),
        ),
        migrations.AddField(
            model_name="storedresponse",
            name="num_bytes",
            field=models.PositiveBigIntegerField(default=0),
        ),
        migrations.AddField(
            model_name="storedresponse",
            name="deleted_at",
            field=models.DateTimeField(blank=True, null=True),
        ),
        migrations.RunPython(to_chains, to_copies),
        migrations.RemoveField(
            model_name="storedresponse",
            name="input_items",
        ),
    ]
