from django.apps import AppConfig


class InferenceConfig(AppConfig):
    name = "inference"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from accounts import limits
        from inference.services.spend import budget_usage

        # Budgets other than a key's monthly tokens are seeded from the daily roll-ups, which
        # accounts cannot read itself.
        limits.budget_usage_source(budget_usage)
