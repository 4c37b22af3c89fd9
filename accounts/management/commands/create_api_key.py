import argparse
from datetime import timedelta

from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError
from django.utils import timezone

from accounts.models import DEFAULT_SERVICE_TIERS
from accounts.services import api_key_create, team_membership_ensure, user_get_or_create


def _positive(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be a positive whole number, not {value!r}")
    return number


class Command(BaseCommand):
    help = "Create an API key (creating the user and team if missing); prints the raw key last."

    def add_arguments(self, parser):
        parser.add_argument("--user", required=True, help="username (created if missing)")
        parser.add_argument("--team", help="team name (created if missing; default: the username)")
        parser.add_argument("--models", default="all", help="comma-separated model names, or 'all'")
        parser.add_argument("--rpm", type=_positive, help="requests per minute")
        parser.add_argument("--tpm", type=_positive, help="tokens per minute")
        parser.add_argument("--max-parallel", type=_positive, help="parallel requests")
        parser.add_argument("--budget-tokens", type=_positive, help="monthly token budget")
        parser.add_argument(
            "--max-output-tokens", type=_positive, help="the most one request may generate"
        )
        parser.add_argument("--expires-days", type=_positive, help="days until the key expires")
        parser.add_argument("--name", default="", help="label")
        parser.add_argument(
            "--service-tiers",
            default=",".join(DEFAULT_SERVICE_TIERS),
            help="comma-separated tiers its requests may use: priority, default, flex",
        )

    def handle(self, *args, **options):
        models = None
        if options["models"].strip().lower() != "all":
            models = [m.strip() for m in options["models"].split(",") if m.strip()]
            if not models:
                raise CommandError("--models needs model names or 'all'.")
        user = user_get_or_create(username=options["user"])
        team, _ = team_membership_ensure(user=user, team_name=options["team"] or options["user"])
        expires_at = None
        if options["expires_days"]:
            expires_at = timezone.now() + timedelta(days=options["expires_days"])
        tiers = [t.strip() for t in options["service_tiers"].split(",") if t.strip()]
        try:
            api_key, raw_key = api_key_create(
                user=user,
                team=team,
                name=options["name"],
                models=models,
                rpm=options["rpm"],
                tpm=options["tpm"],
                max_parallel=options["max_parallel"],
                budget_tokens=options["budget_tokens"],
                max_output_tokens=options["max_output_tokens"],
                expires_at=expires_at,
                service_tiers=tiers,
            )
        except ValidationError as exc:
            raise CommandError(f"--service-tiers: {' '.join(exc.messages)}") from None
        self.stderr.write(
            f"Created key {api_key.prefix}… for {user} in team {team}. "
            "Store it now: it cannot be shown again."
        )
        self.stdout.write(raw_key)
