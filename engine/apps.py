from django.apps import AppConfig


class EngineConfig(AppConfig):
    """Django glue for the engine: management commands only; the engine core stays plain Python."""

    name = "engine"
    verbose_name = "Engine"
