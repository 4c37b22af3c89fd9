"""Admin for the model registry: the entries' settings, what this process's engine says of each
(status, load errors, prefix cache), and the actions on them (enable, default, reload, clear)."""

import datetime
import time
from pathlib import Path

from asgiref.sync import async_to_sync
from django import forms
from django.conf import settings
from django.contrib import admin, messages
from django.db import transaction

from engine import folder_context_length
from inference.admin.lists import WideListMixin
from inference.admin.prices import ModelPriceInline
from inference.models import ERROR_DEFAULT_MUST_BE_ENABLED, ModelEntry
from inference.services.catalog import STATUS_LABELS
from inference.services.engines import get_engine_client, registry_changed
from inference.services.registry import model_folder_problem, model_set_default, model_spec


class ModelEntryForm(forms.ModelForm):
    def clean(self):
        """A new or changed path must be a model folder of the entry's kind. Remote workers
        read their own disks (the web host may have no copy), so there the workers' load
        reports a bad path, in the status column."""
        cleaned = super().clean()
        path, kind = cleaned.get("path"), cleaned.get("kind")
        changed = self.instance._state.adding or {"path", "kind"} & set(self.changed_data)
        if path and kind and changed and settings.ORCHARD_ENGINE == "local":
            problem = model_folder_problem(path, kind=kind)
            if problem:
                self.add_error("path", problem)
            else:
                cleaned["path"] = str(Path(path).expanduser().resolve())
        return cleaned


@admin.register(ModelEntry)
class ModelEntryAdmin(WideListMixin, admin.ModelAdmin):
    form = ModelEntryForm
    list_display = [
        "name",
        "enabled",
        "is_default",
        "kind",
        "engine",
        "context",
        "status",
        "residency",
        "cache",
    ]
    list_editable = ["enabled"]
    list_filter = ["enabled", "kind", "engine"]
    search_fields = ["name", "path"]
    inlines = [ModelPriceInline]  # its price history (inference/admin/prices.py)
    actions = [
        "enable",
        "disable",
        "make_default",
        "load",
        "unload",
        "pin",
        "unpin",
        "reload",
        "clear_cache",
    ]
    readonly_fields = [
        "is_default",
        "status",
        "load_error",
        "cache_stats",
        "source",
        "source_revision",
        "quantization_bits",
        "quantization_group_size",
        "size_on_disk_bytes",
        "created_at",
        "updated_at",
    ]
    fieldsets = [
        (None, {"fields": ["name", "kind", "path", "enabled", "is_default", "engine"]}),
        ("Engine", {"fields": ["status", "load_error"]}),
        ("Residency", {"fields": ["pinned", "idle_unload_seconds"]}),
        (
            "Source",
            {
                "fields": [
                    "source",
                    "source_revision",
                    "quantization_bits",
                    "quantization_group_size",
                    "size_on_disk_bytes",
                ]
            },
        ),
        ("Parsers", {"fields": ["tool_parser", "reasoning_parser"]}),
        (
            "Generation",
            {
                "fields": [
                    "context_length",
                    "default_max_tokens",
                    "max_output_tokens",
                    "default_sampling",
                ]
            },
        ),
        (
            "Batching",
            {
                "fields": [
                    "max_num_seqs",
                    "max_num_batched_tokens",
                    "max_waiting",
                    "speculative_tokens",
                    "draft_model",
                ]
            },
        ),
        (
            "Memory and prefix cache",
            {
                "fields": [
                    "prefill_chunk_tokens",
                    "memory_budget_bytes",
                    "prefix_cache_bytes",
                    "prefix_cache_shared",
                    "kv_cache_bits",
                    "kv_cache_group_size",
                    "cache_stats",
                ]
            },
        ),
        (None, {"fields": ["created_at", "updated_at"]}),
    ]

    @admin.display(description="context", ordering="context_length")
    def context(self, obj: ModelEntry) -> str:
        if obj.context_length:
            return f"{obj.context_length:,}"
        own = folder_context_length(obj.path)
        return f"{own:,} (model's own)" if own else "-"

    @admin.display(description="engine status")
    def status(self, obj: ModelEntry) -> str:
        """What this web process's engine serves under the name (its own view: each process
        runs its own engines)."""
        if obj.pk is None:
            return "-"
        status = get_engine_client().model_status(obj.name)
        text = STATUS_LABELS.get(status.state, status.state)
        if status.state == "serving" and status.loading is not None:
            text += ", reloading"
        if status.error and status.state != "failed":
            text += ", last reload failed"
        return text

    @admin.display(description="memory and use")
    def residency(self, obj: ModelEntry) -> str:
        """What the model holds in the memory budget (weights and its caches' budget), whether
        it is pinned, its last request and its requests now."""
        if obj.pk is None:
            return "-"
        status = get_engine_client().model_status(obj.name)
        parts = [_megabytes(status.memory_bytes) if status.memory_bytes else "not in memory"]
        if obj.pinned:
            parts[0] += ", pinned"
        if status.last_used is not None:
            parts.append(f"last request {_ago(time.time() - status.last_used)}")
        if status.stats is not None and (status.stats.num_running or status.stats.num_waiting):
            parts.append(f"{status.stats.num_running} running, {status.stats.num_waiting} waiting")
        return "; ".join(parts)

    @admin.display(description="last load error")
    def load_error(self, obj: ModelEntry) -> str:
        if obj.pk is None:
            return "-"
        status = get_engine_client().model_status(obj.name)
        if not status.error:
            return "-"
        when = datetime.datetime.fromtimestamp(status.failed_at, tz=datetime.UTC)
        return f"{status.error} (at {when:%Y-%m-%d %H:%M:%S} UTC, path {status.failed_spec.path})"

    @admin.display(description="prefix cache")
    def cache(self, obj: ModelEntry) -> str:
        stats = self._cache_stats(obj)
        if stats is None:
            return "-"
        memory_hits = stats["hits"] - stats.get("disk_hits", 0)
        rate = f", {memory_hits / stats['lookups']:.0%} hits" if stats["lookups"] else ""
        text = f"{_megabytes(stats['bytes'])} of {_megabytes(stats['max_bytes'])}{rate}"
        if not stats.get("disk_max_bytes"):
            return text
        lookups = stats.get("disk_lookups", 0)
        rate = f", {stats.get('disk_hits', 0) / lookups:.0%} hits" if lookups else ""
        disk = f"{_megabytes(stats['disk_bytes'])} of {_megabytes(stats['disk_max_bytes'])}"
        return f"{text}; disk {disk}{rate}"

    @admin.display(description="prefix cache statistics")
    def cache_stats(self, obj: ModelEntry) -> str:
        stats = self._cache_stats(obj)
        if stats is None:
            return "- (the model is not loaded in this process, or has no prefix cache)"
        disk_hits, disk_tokens = stats.get("disk_hits", 0), stats.get("disk_hit_tokens", 0)
        memory = (
            f"{stats['nodes']:,} entries, {_megabytes(stats['bytes'])} of "
            f"{_megabytes(stats['max_bytes'])}; {stats['lookups']:,} lookups, "
            f"{stats['hits'] - disk_hits:,} hits, {stats['hit_tokens'] - disk_tokens:,} prompt "
            f"tokens not recomputed; {stats['evictions']:,} evictions "
            f"({_megabytes(stats['evicted_bytes'])})"
        )
        if not stats.get("disk_max_bytes"):
            return f"{memory}. Disk: off."
        stopped = "" if stats["disk_spilling"] else " (stopped: a write failed, see the log)"
        return (
            f"{memory}. Disk: {stats['disk_entries']:,} files, "
            f"{_megabytes(stats['disk_bytes'])} of {_megabytes(stats['disk_max_bytes'])}; "
            f"{stats['disk_lookups']:,} lookups, {disk_hits:,} hits, {disk_tokens:,} prompt "
            f"tokens read back; {stats['disk_spills']:,} spills "
            f"({_megabytes(stats['disk_spill_bytes'])}){stopped}, "
            f"{stats['disk_spills_dropped']:,} dropped, {stats['disk_evictions']:,} evictions; "
            f"{stats['disk_read_errors']:,} bad files, {stats['disk_write_errors']:,} write errors"
        )

    def _cache_stats(self, obj: ModelEntry) -> dict | None:
        if obj.pk is None:
            return None
        status = get_engine_client().model_status(obj.name)
        return status.stats.prefix_cache if status.stats and status.stats.prefix_cache else None

    @admin.action(description="Clear the prefix cache of selected models", permissions=["change"])
    def clear_cache(self, request, queryset):
        client = get_engine_client()
        freed = sum(client.clear_prefix_cache(entry.name) for entry in queryset)
        self.message_user(request, f"Freed {_megabytes(freed)} of prefix cache.")

    @admin.action(
        description="Reload selected models (retries a failed load)", permissions=["change"]
    )
    def reload(self, request, queryset):
        client = get_engine_client()
        entries = list(queryset.filter(enabled=True))
        for entry in entries:
            client.start_loading(model_spec(entry), force=True)
        self.message_user(
            request,
            f"Loading {len(entries)} model(s); each keeps serving its current version until the "
            "new one is ready. The engine status column shows how it went.",
        )

    @admin.action(
        description="Load selected models now (idle models make room)", permissions=["change"]
    )
    def load(self, request, queryset):
        client = get_engine_client()
        entries = list(queryset.filter(enabled=True))
        for entry in entries:
            client.start_loading(model_spec(entry))
        self.message_user(
            request,
            f"Loading {len(entries)} model(s). Where the memory budget has no room even after "
            "unloading idle models, the last load error says so.",
        )

    @admin.action(
        description="Unload selected models (they load again on their next request)",
        permissions=["change"],
    )
    def unload(self, request, queryset):
        client = get_engine_client()
        names = [entry.name for entry in queryset]
        for name in names:
            async_to_sync(client.unload_model)(name, drain=True)
        self.message_user(
            request,
            f"Unloading {len(names)} model(s): each finishes the requests it is running, then "
            "frees its memory.",
        )

    @admin.action(description="Pin selected models (never unloaded)", permissions=["change"])
    def pin(self, request, queryset):
        self.message_user(request, f"Pinned {queryset.update(pinned=True)} model(s).")
        transaction.on_commit(registry_changed)

    @admin.action(description="Unpin selected models", permissions=["change"])
    def unpin(self, request, queryset):
        self.message_user(request, f"Unpinned {queryset.update(pinned=False)} model(s).")
        transaction.on_commit(registry_changed)

    def save_model(self, request, obj, form, change):
        super().save_model(request, obj, form, change)
        transaction.on_commit(registry_changed)

    def delete_model(self, request, obj):
        super().delete_model(request, obj)
        transaction.on_commit(registry_changed)

    def delete_queryset(self, request, queryset):
        super().delete_queryset(request, queryset)
        transaction.on_commit(registry_changed)

    @admin.action(description="Enable selected models", permissions=["change"])
    def enable(self, request, queryset):
        self.message_user(request, f"Enabled {queryset.update(enabled=True)} model(s).")
        transaction.on_commit(registry_changed)

    @admin.action(description="Disable selected models", permissions=["change"])
    def disable(self, request, queryset):
        if queryset.filter(is_default=True).exists():
            self.message_user(request, ERROR_DEFAULT_MUST_BE_ENABLED, messages.WARNING)
        count = queryset.filter(is_default=False).update(enabled=False)
        self.message_user(request, f"Disabled {count} model(s).")
        transaction.on_commit(registry_changed)

    @admin.action(description="Make the selected model the default", permissions=["change"])
    def make_default(self, request, queryset):
        if queryset.count() != 1:
            self.message_user(request, "Select exactly one model.", messages.ERROR)
            return
        entry = queryset.get()
        if not entry.enabled:
            self.message_user(
                request, f"Enable {entry} before making it the default.", messages.ERROR
            )
            return
        model_set_default(entry=entry)
        self.message_user(request, f"{entry} is now the default model.")


def _ago(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 120:
        return f"{seconds:.0f} s ago"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min ago"
    return f"{seconds / 3600:.0f} h ago"


def _megabytes(num_bytes: int) -> str:
    return f"{num_bytes / 1e6:,.1f} MB"
