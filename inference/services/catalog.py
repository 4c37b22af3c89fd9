"""What the pages say of a model, true to what the API does with it: the parsers a chat reply
goes through, the context requests are checked against, how the weights are stored and their
size on disk. A model the engine serves is described by the engine's own facts (`ModelInfo`,
`EmbeddingInfo`, the same the API validates against); one it does not serve yet, by its folder
and registry entry, and its parsers are known once it loads. Nothing here loads a model."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from engine import (
    EmbeddingInfo,
    EngineError,
    EngineStats,
    ModelInfo,
    folder_context_length,
    folder_embedding_context_length,
    folder_facts,
)
from inference.models import ModelEntry
from inference.services.engines import get_engine_client
from inference.services.generation import model_parsers
from inference.services.registry import model_spec

# ModelStatus.state as the pages say it.
STATUS_LABELS = {
    "serving": "loaded",
    "loading": "loading",
    "failed": "load failed",
    "stopped": "stopped (engine died)",
    "draining": "draining (its engine workers are shutting down)",
    "not_loaded": "unloaded",
}
PARSER_NONE = "none"
PARSER_UNKNOWN = "known once loaded"


@dataclass(frozen=True)
class ModelFacts:
    entry: ModelEntry
    state: str  # a ModelStatus state
    context_length: int | None
    # The parser's name, PARSER_NONE or PARSER_UNKNOWN; None for an embedding model.
    tool_parser: str | None
    reasoning_parser: str | None
    quantization: str | None
    size_bytes: int | None
    # Serving: its weights (their size on disk) and its caches now (the running sequences'
    # and the prefix cache), and the memory budget those caches share; else None.
    memory_bytes: int | None = None
    memory_budget_bytes: int | None = None

    @property
    def status(self) -> str:
        return STATUS_LABELS.get(self.state, self.state)


def models_offered(entries: list[ModelEntry]) -> list[ModelEntry]:
    """The entries a client is offered (/v1/models): not those whose last load failed while
    nothing serves them (their requests get a 503 saying so), until a reload, a change of their
    entry, or a request after the retry interval loads them."""
    client = get_engine_client()
    return [entry for entry in entries if client.model_status(entry.name).state != "failed"]


async def model_catalog(entries: list[ModelEntry]) -> list[ModelFacts]:
    """Each entry's facts: the serving engines' infos asked on the event loop (the client's
    own), states and folders read on threads."""
    client = get_engine_client()
    # On a thread: remote workers' states may be read from Redis.
    statuses = await asyncio.to_thread(lambda: [client.model_status(e.name) for e in entries])
    served = []
    for entry, status in zip(entries, statuses, strict=True):
        state = status.state
        info: ModelInfo | EmbeddingInfo | None = None
        if state == "serving":
            # Serving: the engine answers at once, without loading anything.
            spec = model_spec(entry)
            serving = client.embedding_model if entry.kind == "embedding" else client.serving_model
            try:
                info = await serving(spec)
            except EngineError:
                pass  # stopped since: described by its folder
        served.append((entry, state, info, status.stats if info is not None else None))
    return await asyncio.to_thread(lambda: [_facts(*each) for each in served])


def _facts(
    entry: ModelEntry,
    state: str,
    info: ModelInfo | EmbeddingInfo | None,
    stats: EngineStats | None = None,
) -> ModelFacts:
    folder = folder_facts(entry.path)
    tool = reasoning = None
    if isinstance(info, ModelInfo):
        tool, reasoning = (name or PARSER_NONE for name in model_parsers(entry, info))
        context = info.context_length
    elif isinstance(info, EmbeddingInfo):
        context = info.context_length
    elif entry.kind == ModelEntry.Kind.EMBEDDING:
        context = folder_embedding_context_length(entry.path)
    else:
        # Until it loads, only what the registry names (a failed load never tells the rest).
        unknown = PARSER_UNKNOWN if state in ("not_loaded", "loading") else None
        tool = entry.tool_parser or unknown
        reasoning = entry.reasoning_parser or unknown
        context = entry.context_length or folder_context_length(entry.path)
    return ModelFacts(
        entry=entry,
        state=state,
        context_length=context,
        tool_parser=tool,
        reasoning_parser=reasoning,
        quantization=folder.quantization if folder else None,
        size_bytes=folder.size_bytes if folder else None,
        **_memory(folder.size_bytes if folder else None, stats),
    )


def _memory(weights: int | None, stats: EngineStats | None) -> dict[str, int | None]:
    if stats is None or weights is None:
        return {}
    caches = stats.kv_cache_bytes + (stats.prefix_cache or {}).get("bytes", 0)
    return {
        "memory_bytes": weights + caches,
        "memory_budget_bytes": stats.memory_budget_bytes or None,
    }
