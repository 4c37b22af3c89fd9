"""Report pages at scale, with their cost columns: a million usage rows, then each report page
and the usage and costs APIs timed.

    .venv/bin/python bench/reports.py [--rows 1000000] [--repeat 5] [--no-write]

Fills a throwaway SQLite database (var/bench-reports.sqlite3, or DATABASE_URL) with `--rows`
finished usage rows over 90 days, 5 teams, 60 keys and 4 priced models (each row with its cost
per line item, as the server writes it; every tenth a line of a batch, which the reports show
apart), with bulk inserts, then their daily roll-ups; gives the
first team a money budget and its first member a token budget (the keys page reads what they
used). Times each page a member, an owner, staff and a script read (best and median of
`--repeat`, through Django's test client, rendering included). Target: every one under 300 ms.
Results go in bench/RESULTS.md (its own section, rewritten by each run).
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

from decimal import Decimal  # noqa: E402

from django.core.management import call_command  # noqa: E402
from django.db import connection, transaction  # noqa: E402
from django.db.models import Count, Q, Sum  # noqa: E402
from django.test import Client  # noqa: E402
from django.utils import timezone  # noqa: E402

from accounts.models import Budget, Membership  # noqa: E402
from accounts.services import api_key_create, team_membership_ensure, user_get_or_create  # noqa: E402
from bench.results import load_average, run_header, write_results  # noqa: E402
from inference.models import DailyUsage, ModelEntry, ModelPrice, UsageRecord  # noqa: E402
from inference.services.prices import Cost, Price  # noqa: E402

MODELS = ["smollm2-135m-instruct", "qwen3-8b", "llama-3.1-8b", "gpt-oss-20b"]
# Per million tokens: input, cached input, output.
PRICES = [
    ("0.02", "0.01", "0.06"),
    ("0.15", "0.075", "0.6"),
    ("0.2", None, "0.8"),
    ("1", "0.5", "4"),
]
DAYS = 90
TARGET_MS = 300


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
    prices = []
    for name, (cin, cached, cout) in zip(MODELS, PRICES, strict=True):
        entry = ModelEntry.objects.create(name=name, path=f"/models/{name}")
        prices.append(
            Price.of(
                ModelPrice.objects.create(
                    model=entry,
                    effective_from=now - datetime.timedelta(days=DAYS + 1),
                    input_per_million=Decimal(cin),
                    cached_input_per_million=None if cached is None else Decimal(cached),
                    output_per_million=Decimal(cout),
                )
            )
        )
    # These prices are whole nano-units a token: Price.cost's result, in integers (fast).
    assert all(rate == int(rate) for p in prices for rate in (p.input, p.cached_input, p.output))
    costs = [
        lambda n, c, o, p=p: Cost(
            int(p.input) * (n - c), int(p.cached_input) * c, int(p.output) * o
        )
        for p in prices
    ]
    Budget.objects.create(team=teams[0], scope="team", unit="money", amount=Decimal("500"))
    Budget.objects.create(
        team=teams[0], scope="member", user=keys[1].user, unit="tokens", amount=10**9
    )
    batch = []
    start = time.perf_counter()
    for index in range(num_rows):
        key = keys[rng.randrange(len(keys))]
        started = now - datetime.timedelta(seconds=rng.randrange(DAYS * 86400))
        model = rng.randrange(len(MODELS))
        prompt, cached, completion = (
            rng.randrange(10, 4000),
            rng.randrange(0, 10),
            rng.randrange(1, 800),
        )
        cost = costs[model](prompt, cached, completion)
        batch.append(
            UsageRecord(
                request_id=f"req_{index:016x}",
                api_key=key,
                team_id=key.team_id,
                user_id=key.user_id,
                model=MODELS[model],
                endpoint="chat.completions",
                status="completed",
                prompt_tokens=prompt,
                cached_tokens=cached,
                completion_tokens=completion,
                input_cost=cost.input,
                cached_input_cost=cost.cached_input,
                output_cost=cost.output,
                started_at=started,
                finished_at=started,
                duration_ms=100,
                batch_id=f"batch_{index % 50:04x}" if index % 10 == 0 else "",
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
            UsageRecord.objects.annotate(batch=~Q(batch_id=""))
            .values("started_at__date", "team_id", "api_key_id", "model", "batch")
            .annotate(
                n=Count("id"),
                p=Sum("prompt_tokens"),
                c=Sum("cached_tokens"),
                o=Sum("completion_tokens"),
                ci=Sum("input_cost"),
                cc=Sum("cached_input_cost"),
                co=Sum("output_cost"),
            )
            .order_by()
        )
        DailyUsage.objects.bulk_create(
            DailyUsage(
                date=row["started_at__date"],
                team_id=row["team_id"],
                api_key_id=row["api_key_id"],
                model=row["model"],
                batch=row["batch"],
                num_requests=row["n"],
                num_completed=row["n"],
                prompt_tokens=row["p"],
                cached_tokens=row["c"],
                completion_tokens=row["o"],
                input_cost=row["ci"],
                cached_input_cost=row["cc"],
                output_cost=row["co"],
            )
            for row in sums
        )
    filled = (
        f"{UsageRecord.objects.count():,} finished usage rows over {DAYS} days (5 teams, "
        f"60 keys, 4 priced models), {DailyUsage.objects.count():,} daily roll-ups, filled in "
        f"{time.perf_counter() - start:.0f} s ({connection.vendor})"
    )
    print(filled, flush=True)
    return teams, keys, owner, filled


def timed(client: Client, url: str, repeat: int, **headers) -> tuple[float, float]:
    """Best and median of `repeat` requests, after one not counted (the process's first use of
    a template or a query compiles it)."""
    assert client.get(url, **headers).status_code == 200, url
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
    parser.add_argument("--no-write", action="store_true", help="leave bench/RESULTS.md alone")
    args = parser.parse_args()
    load_before = load_average()
    call_command("migrate", verbosity=0)
    teams, keys, owner, filled = fill(args.rows)
    member = keys[1].user
    since = (timezone.now().date() - datetime.timedelta(days=DAYS - 1)).isoformat()
    team = teams[0].pk
    pages = [
        ("member", member, "/usage/", "`/usage/` (30 days)"),
        ("member", member, f"/usage/?since={since}", "`/usage/?since=…` (90 days)"),
        ("member", member, "/keys/", "`/keys/` (a team and a member budget)"),
        ("owner", owner, "/teams/", "`/teams/` (this month, per team)"),
        ("owner", owner, f"/teams/{team}/", f"`/teams/{team}/` (30 days)"),
        ("owner", owner, f"/teams/{team}/?since={since}", f"`/teams/{team}/?since=…` (90 days)"),
        ("owner", owner, f"/teams/{team}/?since={since}&format=csv", "the same as CSV"),
        ("staff", None, f"/admin/inference/usagerecord/totals/?since={since}", "admin totals"),
        ("staff", None, "/admin/", "`/admin/` (today's cost)"),
    ]
    from django.contrib.auth import get_user_model

    staff = get_user_model().objects.create_superuser("bench-admin", "", "bench-password-1")
    results = []
    for who, user, url, label in pages:
        client = Client()
        client.force_login(user or staff)
        results.append((who, label, *timed(client, url, args.repeat)))
        print(f"{who:6} | {url} | {results[-1][2]:7.1f} | {results[-1][3]:9.1f}", flush=True)
    reader = api_key_create(user=owner, team=teams[0], reads_usage=True)[1]
    start_time = int((timezone.now() - datetime.timedelta(days=DAYS)).timestamp())
    for url, label in (
        (
            f"/v1/organization/usage/completions?start_time={start_time}&group_by=model&limit=31",
            "`/v1/organization/usage/completions` (31 days by model)",
        ),
        (
            f"/v1/organization/costs?start_time={start_time}&group_by=line_item&limit=31",
            "`/v1/organization/costs` (31 days by line item)",
        ),
        (
            f"/v1/organization/costs?start_time={start_time}&limit=180",
            "`/v1/organization/costs` (90 days)",
        ),
    ):
        best, median = timed(Client(), url, args.repeat, HTTP_AUTHORIZATION=f"Bearer {reader}")
        results.append(("script", label, best, median))
        print(f"script | {url.split('?')[0]} | {best:7.1f} | {median:9.1f}", flush=True)
    slowest = max(median for *_, median in results)
    lines = [
        *run_header(
            "reports.py",
            f"; load average {load_before} before the run, {load_average()} after.",
        ),
        "",
        f"{filled}. Times through Django's test client, rendering included, best and median "
        f"of {args.repeat} after one warm-up request:",
        "",
        "| who | page | best ms | median ms |",
        "| --- | --- | ---: | ---: |",
        *(
            f"| {who} | {label} | {best:.1f} | {median:.1f} |"
            for who, label, best, median in results
        ),
        "",
        f"Slowest median {slowest:.1f} ms (target: every page under {TARGET_MS} ms): "
        f"{'pass' if slowest < TARGET_MS else 'FAIL'}.",
    ]
    block = "\n".join(lines)
    print(block)
    if not args.no_write:
        write_results("reports.py", "Report pages at a million usage rows", block)


if __name__ == "__main__":
    main()
