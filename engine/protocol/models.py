"""What the engine is told about a model (`ModelSpec`) and what it reports back: a loaded model's
facts (`ModelInfo`, `EmbeddingInfo`), where a name stands (`ModelStatus`), its load
(`EngineStats`), and how far an embedding call got (`EmbeddingProgress`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from engine.protocol.generation import MAX_CHOICES


@dataclass(frozen=True)
class ModelSpec:
    """What the engine needs to load and serve one model (built from a registry entry)."""

    name: str
    path: str
    engine: str = "batched"  # "batched" | "simple"
    kind: str = "chat"  # "chat" | "embedding" (a sentence encoder: engine/models/embeddings.py)
    context_length: int | None = None  # None: read from the model's config
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_waiting: int = 256
    # Prefill tokens per step while other sequences decode (None: sized by the engine from
    # its measured prefill speed, so running streams keep flowing).
    prefill_chunk_tokens: int | None = None
    # Bytes for the running sequences' caches and the prefix cache together (None: a share of
    # the machine's memory), and the prefix cache's own cap within that (None: a quarter;
    # 0: no prefix cache).
    memory_budget_bytes: int | None = None
    prefix_cache_bytes: int | None = None
    # Keys and values kept quantized (engine/cache/quantized.py): 8 or 4 bits per element in
    # groups of `kv_cache_group_size` along the head dimension; None: the model's own precision.
    kv_cache_bits: int | None = None
    kv_cache_group_size: int = 64
    # The decode batch's attention caches in length cohorts (engine/cache/cohorts.py), so a
    # row's keys and values cost its own length; off: every row at the longest row's length.
    compact_kv: bool = True
    # Speculative decoding (engine/core/speculative.py): the longest draft a decode step checks per
    # sequence; 0: off. Drafts come from `draft_path`'s model where set (a smaller model of
    # the same tokenizer, engine/core/draft_model.py), else by prompt lookup.
    speculative_tokens: int = 0
    draft_path: str | None = None
    # Fair share between tenants and service tiers (engine/core/fairness.py); off: arrival
    # order. A tier below the top keeps at least this share of the batch's rows while it has
    # work; the lowest (flex) keeps at most `flex_yield_share` of them while a higher tier has
    # requests (1: all it can get).
    fair_share: bool = True
    tier_min_share: float = 0.1
    flex_yield_share: float = 0.25
    # Residency in the worker's memory budget (engine/cache/host.py): a pinned model is never
    # unloaded to make room or after idling; others unload after `idle_unload_s` seconds
    # without requests (None: the worker's default; 0: never). Not part of a spec's identity:
    # changing them never reloads the model.
    pinned: bool = field(default=False, compare=False)
    idle_unload_s: float | None = field(default=None, compare=False)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ModelSpec:
        return cls(**data)


@dataclass(frozen=True)
class ModelInfo:
    """What the engine reports about a loaded model."""

    name: str
    context_length: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    supports_tools: bool = False
    max_choices: int = MAX_CHOICES  # the most choices (n) one request may ask for
    # The most tokens (prompt + completion, summed over choices) one request may hold in the
    # engine's memory budget; None: no limit known.
    max_request_tokens: int | None = None
    hybrid: bool = False  # recurrent layers: prompt checkpoints are worth computing
    # The chat template the model renders with ("" if none): the server detects the tool-call
    # and reasoning syntax from it when the registry names no parser.
    chat_template: str = ""
    # The tokenizer's added tokens (<tool_call>, <|python_tag|>, [TOOL_CALLS], ...) by their ids,
    # which a grammar names as tokens rather than text (inference/services/structured.py).
    added_tokens: Mapping[str, int] = field(default_factory=dict)
    # What a prompt may hold: ("text",), or ("text", "image") on a vision model.
    input_kinds: tuple[str, ...] = ("text",)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ModelInfo:
        eos, added = tuple(data["eos_token_ids"]), dict(data.get("added_tokens", {}))
        kinds = tuple(data.get("input_kinds", ("text",)))
        return cls(**{**data, "eos_token_ids": eos, "added_tokens": added, "input_kinds": kinds})


@dataclass(frozen=True)
class ModelStatus:
    """Where a model name stands in an engine worker, for the admin: `state` is "serving",
    "loading" (nothing serves it yet), "failed" (its last load failed and nothing serves it),
    "stopped" (its engine died) or "not_loaded". A failed reload beside a serving engine keeps
    `state` "serving" and sets `error`."""

    name: str
    state: str
    serving: ModelSpec | None = None
    loading: ModelSpec | None = None
    error: str | None = None
    failed_at: float | None = None  # Unix time of the failure
    failed_spec: ModelSpec | None = None
    # The failure's error code: "model_capacity_exceeded" when the memory budget had no room.
    failure_code: str | None = None
    stats: EngineStats | None = None  # of the serving engine
    restarts: int = 0  # times its engine died and was started again by the worker
    # Its place in the worker's memory budget: bytes held (weights and caches' budget, of
    # every engine of the name), Unix time of its last request, and its residency settings.
    memory_bytes: int = 0
    last_used: float | None = None
    pinned: bool = False
    idle_unload_s: float | None = None


@dataclass(frozen=True)
class EngineStats:
    """Per-model load, for admin, `/metrics` and (later) routing between workers."""

    model: str
    num_waiting: int = 0
    num_running: int = 0
    tokens_per_second: float = 0.0
    step_time_ms: float = 0.0
    num_steps: int = 0
    num_generated_tokens: int = 0
    num_prompt_tokens: int = 0
    num_cached_prompt_tokens: int = 0
    prefill_chunk_tokens: int = 0
    memory_budget_bytes: int = 0
    # Speculative decoding: draft tokens checked, and of those accepted (since load).
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0
    prefix_cache: Mapping[str, int] = field(default_factory=dict)  # PrefixCacheStats.to_dict()
    # Fair share (engine/core/fairness.py): sequences preempted since load, and per tenant
    # its requests waiting, rows running, and prompt and generated tokens served since load.
    num_preemptions: int = 0
    tenants: Mapping[str, Mapping[str, int]] = field(default_factory=dict)
    # Bytes the running sequences' caches hold now (as the memory budget counts them).
    kv_cache_bytes: int = 0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> EngineStats:
        tenants = {t: dict(v) for t, v in (data.get("tenants") or {}).items()}
        return cls(
            **{**data, "prefix_cache": dict(data.get("prefix_cache") or {}), "tenants": tenants}
        )


@dataclass(frozen=True)
class EmbeddingInfo:
    """What the engine reports about a loaded embedding model."""

    name: str
    dimensions: int
    context_length: int  # tokens per input, special tokens included
    vocab_size: int
    normalize: bool
    pooling: str  # "mean" | "cls" | "max"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> EmbeddingInfo:
        return cls(**data)


@dataclass
class EmbeddingProgress:
    """How far an `EngineClient.embed` call got: the tokens of the inputs the model embedded.
    Final once `embed` has returned or raised: a cancelled call stops between the model's
    forwards and waits (briefly) for the engine to say how far it got, so a client that leaves
    is billed what its request cost."""

    num_computed_tokens: int = 0
