from django.core.management.base import BaseCommand, CommandError

from accounts.models import ApiKey
from accounts.services import api_key_find, api_key_revoke


class Command(BaseCommand):
    help = (
        "Revoke an API key given its displayed prefix (sk-orch-XXXXXXXX, as the admin and "
        "create_api_key show it). The raw key also works, but then it lands in your shell history."
    )

    def add_arguments(self, parser):
        parser.add_argument(
            "key_or_prefix",
            help="The key's displayed prefix (normal), or the raw key (kept in shell history).",
        )

    def handle(self, *args, **options):
        try:
            api_key = api_key_find(key_or_prefix=options["key_or_prefix"])
        except ApiKey.DoesNotExist:
            raise CommandError("No API key matches that key or prefix.") from None
        api_key_revoke(api_key=api_key)
        self.stdout.write(f"Revoked {api_key.prefix}….")
