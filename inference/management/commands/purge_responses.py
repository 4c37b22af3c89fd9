import datetime

from django.conf import settings
from django.core.management.base import BaseCommand

from inference.services.stored_responses import responses_purge


class Command(BaseCommand):
    help = "Delete stored /v1/responses responses older than a number of days."

    def add_arguments(self, parser):
        parser.add_argument(
            "--older-than-days",
            type=int,
            default=settings.ORCHARD_RESPONSES_RETENTION_DAYS,
            help="default: ORCHARD_RESPONSES_RETENTION_DAYS (30)",
        )

    def handle(self, *args, **options):
        days = options["older_than_days"]
        if days < 0:
            self.stderr.write("--older-than-days must be 0 or more.")
            raise SystemExit(2)
        deleted = responses_purge(older_than=datetime.timedelta(days=days))
        self.stdout.write(f"Deleted {deleted} stored responses older than {days} days.")
