"""Report pages at scale: a million usage rows, then each report page timed.

    .venv/bin/python bench/reports.py [--rows 1000000] [--repeat 5]

Fills a fresh SQLite database (var/bench-reports.sqlite3, or DATABASE_URL) with `--rows`
finished usage rows over 90 days, 5 teams, 60 keys and 4 models, written the way the server
writes them (rows, then their daily roll-ups), and times each page a member, an owner and a
script read (best and median of `--repeat`, through Django's test client, rendering
included). Results go in bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import datetime
import os
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
os.environ.setdefault("DATABASE_URL", f"sqlite:///{ROOT / 'var' / 'bench-reports.sqlite3'}")
os.environ.setdefault("ORCHARD_PRELOAD_MODELS", "0")

import django  # noqa: E402

django.setup()

from django.core.management import call_command  # noqa: E402
from django.db import connection, transaction  # noqa: E402
from django.db.models import Count, Sum  # noqa: E402
from django.test import Client  # noqa: E402
from django.utils import timezone  # noqa: E402

from accounts.models import Membership  # noqa: E402
from accounts.services import api_key_create, team_membership_ensure, user_get_or_create  # noqa: E402
from inference.models import DailyUsage, UsageRecord  # noqa: E402

MODELS = ["smollm2-135m-instruct", "qwen3-8b", "llama-3.1-8b", "gpt-oss-20b"]
DAYS = 90


def fill(num_rows: int) -> tuple:
    call_command("flush", "--noinput", verbosity=0)
    rng = random.Random(0)
    teams, keys, owner = [], [], None
    for t in range(5):
        for u in range(12):
            user = user_get_or_create(username=f"user{t}-{u}")
            team, _ = team_membership_ensure(user=user, team_name=f"team{t}")
            if u == 0:
                Membership.objects.filter(user=user, team=team).update(role="owner")
                owner = owner or user
            api_key, _ = api_key_create(user=user, team=team, reads_usage=u == 0)
            keys.append(api_key)
        teams.append(team)
    now = timezone.now()
    batch = []
    start = time.perf_counter()
    for index in range(num_rows):
        key = keys[rng.randrange(len(keys))]
        started = now - datetime.timedelta(seconds=rng.randrange(DAYS * 86400))
        batch.append(
            UsageRecord(
                request_id=f"req_{index:016x}",
                api_key=key,
                team_id=key.team_id,
                user_id=key.user_id,
                model=MODELS[rng.randrange(len(MODELS))],
                endpoint="chat.completions",
                status="completed",
                prompt_tokens=rng.randrange(10, 4000),
                cached_tokens=rng.randrange(0, 10),
                completion_tokens=rng.randrange(1, 800),
                started_at=started,
                finished_at=started,
                duration_ms=100,
            )
        )
        if len(batch) == 20_000:
            UsageRecord.objects.bulk_create(batch)
            batch = []
    if batch:
        UsageRecord.objects.bulk_create(batch)
    # The roll-ups the server keeps as it finishes each row.
    with transaction.atomic():
        sums = (
            UsageRecord.objects.values("started_at__date", "team_id", "api_key_id", "model")
            .annotate(
                n=Count("id"),
                p=Sum("prompt_tokens"),
                c=Sum("cached_tokens"),
                o=Sum("completion_tokens"),
            )
            .order_by()
        )
        DailyUsage.objects.bulk_create(
            DailyUsage(
                date=row["started_at__date"],
                team_id=row["team_id"],
                api_key_id=row["api_key_id"],
                model=row["model"],
                num_requests=row["n"],
                num_completed=row["n"],
                prompt_tokens=row["p"],
                cached_tokens=row["c"],
                completion_tokens=row["o"],
            )
            for row in sums
        )
    print(
        f"filled {UsageRecord.objects.count():,} usage rows, {DailyUsage.objects.count():,} "
        f"daily roll-ups in {time.perf_counter() - start:.0f} s ({connection.vendor})"
    )
    return teams, keys, owner


def timed(client: Client, url: str, repeat: int, **headers) -> tuple[float, float]:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        response = client.get(url, **headers)
        times.append((time.perf_counter() - start) * 1000)
        assert response.status_code == 200, (url, response.status_code)
    return min(times), statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    call_command("migrate", verbosity=0)
    teams, keys, owner = fill(args.rows)
    member = keys[1].user
    since = (timezone.now().date() - datetime.timedelta(days=DAYS - 1)).isoformat()
    pages = [
        ("member", member, "/usage/"),
        ("member", member, f"/usage/?since={since}"),
        ("member", member, "/keys/"),
        ("owner", owner, f"/teams/{teams[0].pk}/"),
        ("owner", owner, f"/teams/{teams[0].pk}/?since={since}"),
        ("owner", owner, f"/teams/{teams[0].pk}/?since={since}&format=csv"),
        ("staff", None, f"/admin/inference/usagerecord/totals/?since={since}"),
        ("staff", None, "/admin/"),
    ]
    from django.contrib.auth import get_user_model

    staff = get_user_model().objects.create_superuser("bench-admin", "", "bench-password-1")
    print("who    | page | best ms | median ms")
    for who, user, url in pages:
        client = Client()
        client.force_login(user or staff)
        best, median = timed(client, url, args.repeat)
        print(f"{who:6} | {url} | {best:7.1f} | {median:9.1f}", flush=True)
    reader = api_key_create(user=owner, team=teams[0], reads_usage=True)[1]
    start_time = int((timezone.now() - datetime.timedelta(days=DAYS)).timestamp())
    url = f"/v1/organization/usage/completions?start_time={start_time}&group_by=model&limit=31"
    best, median = timed(Client(), url, args.repeat, HTTP_AUTHORIZATION=f"Bearer {reader}")
    print(f"script | {url.split('?')[0]} (31 days by model) | {best:7.1f} | {median:9.1f}")


if __name__ == "__main__":
    main()
