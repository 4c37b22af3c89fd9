"""The model registry: selectors and services over ModelEntry."""

from pathlib import Path

from django.conf import settings
from django.contrib.auth.models import AbstractBaseUser
from django.core.exceptions import ValidationError
from django.db import transaction

from accounts.models import ApiKey
from common.precompiled import Precompiled
from engine import ModelSpec
from inference.models import ModelEntry
from inference.parsers.registry import REASONING_PARSERS, TOOL_PARSERS


@transaction.atomic
def model_register(
    *,
    name: str,
    path: str | Path,
    engine: str = ModelEntry.Engine.BATCHED,
    tool_parser: str = "",
    reasoning_parser: str = "",
    make_default: bool = False,
    kind: str = ModelEntry.Kind.CHAT,
    draft_model: str | None = None,
) -> ModelEntry:
    """Add or update a registry entry for an mlx-lm model folder (or, with kind "embedding",
    a sentence-transformers encoder folder); `draft_model` names a registered chat model that
    drafts for it (speculative decoding)."""
    folder = Path(path).expanduser().resolve()
    if kind not in ModelEntry.Kind.values:
        raise ValueError(f"Unknown kind {kind!r}; choose from {', '.join(ModelEntry.Kind)}.")
    problem = model_folder_problem(folder, kind=kind)
    if problem:
        raise ValueError(problem)
    if engine not in ModelEntry.Engine.values:
        raise ValueError(f"Unknown engine {engine!r}; choose from {', '.join(ModelEntry.Engine)}.")
    for what, value, known in (
        ("tool parser", tool_parser, TOOL_PARSERS),
        ("reasoning parser", reasoning_parser, REASONING_PARSERS),
    ):
        if value and value not in known:
            raise ValueError(
                f"Unknown {what} {value!r}; choose from {', '.join(known)} (or leave it empty "
                "to detect it from the chat template)."
            )
    entry, _ = ModelEntry.objects.update_or_create(
        name=name,
        defaults={
            "path": str(folder),
            "engine": engine,
            "tool_parser": tool_parser,
            "reasoning_parser": reasoning_parser,
            "kind": kind,
        },
    )
    if draft_model is not None:
        entry.draft_model = ModelEntry.objects.filter(name=draft_model).first()
        if entry.draft_model is None:
            raise ValueError(f"No registered model is called {draft_model!r}.")
        try:
            entry.full_clean()
        except ValidationError as exc:
            raise ValueError(" ".join(exc.messages)) from None
        entry.save(update_fields=["draft_model"])
    if kind == ModelEntry.Kind.CHAT and (
        make_default or not ModelEntry.objects.filter(is_default=True).exists()
    ):
        model_set_default(entry=entry)
    return entry


def model_folder_problem(path: str | Path, *, kind: str) -> str | None:
    """Why `path` cannot be registered as a model of `kind` (a sentence to show), or None. The
    same check wherever a model is added (the admin, the commands), so that a path which can
    never load is refused there instead of being listed and failing at every start."""
    folder = Path(path).expanduser()
    if not folder.exists():
        return f"{folder} does not exist on this server."
    if folder.is_file() and folder.suffix == ".gguf":
        return (
            f"{folder} is a GGUF file: convert it into a model folder first "
            f"(manage.py import_gguf {folder} NAME), which also registers it."
        )
    if not (folder / "config.json").is_file():
        return f"{folder} is not an mlx-lm model folder (no config.json)."
    if kind == ModelEntry.Kind.EMBEDDING and not (folder / "tokenizer.json").is_file():
        return f"{folder} has no tokenizer.json (an embedding model needs one)."
    return None


@transaction.atomic
def model_set_default(*, entry: ModelEntry) -> None:
    ModelEntry.objects.filter(is_default=True).exclude(pk=entry.pk).update(is_default=False)
    if not entry.is_default:
        entry.is_default = True
        entry.save(update_fields=["is_default"])


def model_spec(entry: ModelEntry) -> ModelSpec:
    return ModelSpec(
        name=entry.name,
        path=entry.path,
        engine=entry.engine,
        kind=entry.kind,
        context_length=entry.context_length,
        max_num_seqs=entry.max_num_seqs,
        max_num_batched_tokens=entry.max_num_batched_tokens,
        max_waiting=entry.max_waiting,
        prefill_chunk_tokens=entry.prefill_chunk_tokens,
        memory_budget_bytes=entry.memory_budget_bytes,
        prefix_cache_bytes=entry.prefix_cache_bytes,
        kv_cache_bits=entry.kv_cache_bits,
        kv_cache_group_size=entry.kv_cache_group_size,
        speculative_tokens=entry.speculative_tokens,
        draft_path=entry.draft_model.path if entry.draft_model_id is not None else None,
        fair_share=settings.ORCHARD_FAIR_SHARE,
        tier_min_share=settings.ORCHARD_TIER_MIN_SHARE,
        flex_yield_share=settings.ORCHARD_FLEX_YIELD_SHARE,
        pinned=entry.pinned,
        idle_unload_s=entry.idle_unload_seconds,
    )


def models_for_key(api_key: ApiKey) -> list[ModelEntry]:
    if api_key.all_models:
        return _enabled_entries()
    return list(_enabled().filter(name__in=api_key.allowed_models))


def _enabled():
    return ModelEntry.objects.filter(enabled=True).select_related("draft_model")


# The queries of every /v1/models and every generation, compiled once (common/precompiled.py).
_enabled_entries = Precompiled(_enabled)
_enabled_entry = Precompiled(
    lambda name: _enabled().filter(name=name), "\x00a stand-in for a model's name\x00"
)


def models_for_user(user: AbstractBaseUser) -> list[ModelEntry]:
    """The enabled models one of the user's active keys may use."""
    api_keys = list(ApiKey.objects.active().filter(user=user))
    entries = ModelEntry.objects.filter(enabled=True).select_related("draft_model")
    if not any(api_key.all_models for api_key in api_keys):
        entries = entries.filter(name__in={n for k in api_keys for n in k.allowed_models})
    return list(entries)


def model_for_key(api_key: ApiKey, name: str) -> ModelEntry | None:
    """The enabled entry called `name` if this key may use it; None otherwise (the API answers
    404 either way, so a key cannot probe for models it may not use)."""
    if not _is_model_name(name) or not api_key.allows_model(name):
        return None
    found = _enabled_entry(name)  # names are unique: one row at most
    return found[0] if found else None


def _is_model_name(name: str) -> bool:
    # What a registry name can be; anything else (a NUL byte, which PostgreSQL refuses in a
    # query, or an over-long id) matches no model without asking the database.
    max_length = ModelEntry._meta.get_field("name").max_length
    return 0 < len(name) <= max_length and "\x00" not in name
