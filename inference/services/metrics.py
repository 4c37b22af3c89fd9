"""Prometheus metrics (`GET /metrics`): what the API did, counted in this process, and what the
engines hold now, read at scrape time.

Counters and histograms are fed by the execution of every generating request (its final
status, tokens, time to first token, the gaps between its tokens) and by admission refusals;
engine gauges (queue, running sequences, throughput, prefix cache) come from the engine
client's stats when scraped. With several web processes each serves its own counts.
"""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from engine import EngineStats, ModelStatus

REGISTRY = CollectorRegistry(auto_describe=True)
REQUESTS = Counter(
    "orchard_requests",
    "API requests by endpoint, model and final status (completed, cancelled, failed, rejected).",
    ["endpoint", "model", "status"],
    registry=REGISTRY,
)
PROMPT_TOKENS = Counter(
    "orchard_prompt_tokens", "Prompt tokens.", ["endpoint", "model"], registry=REGISTRY
)
CACHED_TOKENS = Counter(
    "orchard_cached_prompt_tokens",
    "Prompt tokens served from the prefix cache.",
    ["endpoint", "model"],
    registry=REGISTRY,
)
COMPLETION_TOKENS = Counter(
    "orchard_completion_tokens", "Generated tokens.", ["endpoint", "model"], registry=REGISTRY
)
TIME_TO_FIRST_TOKEN = Histogram(
    "orchard_time_to_first_token_seconds",
    "From admission to the first generated token.",
    ["endpoint", "model"],
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64),
    registry=REGISTRY,
)
INTER_TOKEN_LATENCY = Histogram(
    "orchard_inter_token_latency_seconds",
    "Time between consecutive generated tokens of a choice.",
    ["model"],
    buckets=(0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56),
    registry=REGISTRY,
)
LIMITER_REJECTIONS = Counter(
    "orchard_limiter_rejections",
    "Requests refused by the key's limits, by reason (the error code).",
    ["reason"],
    registry=REGISTRY,
)
PREFLIGHTS = Counter(
    "orchard_preflight_checks",
    "Large bodies checked in a preflight process, by verdict: refused (never parsed by the web "
    "process), accepted, or failed (the process failed or was too slow: read here instead).",
    ["verdict"],
    registry=REGISTRY,
)


def request_finished(
    *,
    endpoint: str,
    model: str,
    status: str,
    prompt_tokens: int,
    cached_tokens: int,
    completion_tokens: int,
    time_to_first_token_ms: int | None,
) -> None:
    REQUESTS.labels(endpoint, model, status).inc()
    PROMPT_TOKENS.labels(endpoint, model).inc(prompt_tokens)
    CACHED_TOKENS.labels(endpoint, model).inc(cached_tokens)
    COMPLETION_TOKENS.labels(endpoint, model).inc(completion_tokens)
    if time_to_first_token_ms is not None:
        TIME_TO_FIRST_TOKEN.labels(endpoint, model).observe(time_to_first_token_ms / 1000)


def request_rejected(*, endpoint: str, model: str, reason: str) -> None:
    REQUESTS.labels(endpoint, model, "rejected").inc()
    LIMITER_REJECTIONS.labels(reason).inc()


def inter_token(model: str, seconds_per_token: float, num_tokens: int) -> None:
    histogram = INTER_TOKEN_LATENCY.labels(model)
    for _ in range(num_tokens):
        histogram.observe(seconds_per_token)


class _EngineCollector:
    """The engines' stats at scrape time as gauges (and the prefix cache's totals), and each
    team's share of them (engine/core/fairness.py: queue, rows, tokens served)."""

    def __init__(self, stats: list[EngineStats], teams: Mapping[str, str]):
        self.stats = stats
        self.teams = teams

    def _teams(self):
        labels = ["model", "team"]
        waiting = GaugeMetricFamily(
            "orchard_team_waiting_requests",
            "A team's requests queued for the model.",
            labels=labels,
        )
        running = GaugeMetricFamily(
            "orchard_team_running_sequences", "A team's sequences in the batch.", labels=labels
        )
        prompt = CounterMetricFamily(
            "orchard_team_prompt_tokens",
            "Prompt tokens computed for a team (prefix cache hits excluded), since load.",
            labels=labels,
        )
        generated = CounterMetricFamily(
            "orchard_team_generated_tokens",
            "Tokens generated for a team, since load.",
            labels=labels,
        )
        preemptions = CounterMetricFamily(
            "orchard_engine_preemptions",
            "Sequences preempted for a higher tier or a team's fair share, since load.",
            labels=["model"],
        )
        for stats in self.stats:
            preemptions.add_metric([stats.model], stats.num_preemptions)
            for tenant, counts in stats.tenants.items():
                row = [stats.model, self.teams.get(tenant, tenant)]
                waiting.add_metric(row, counts.get("waiting", 0))
                running.add_metric(row, counts.get("running", 0))
                prompt.add_metric(row, counts.get("prefill_tokens", 0))
                generated.add_metric(row, counts.get("decode_tokens", 0))
        return waiting, running, prompt, generated, preemptions

    def collect(self):
        gauges = {
            "waiting": ("orchard_engine_waiting_requests", "Requests queued for the model."),
            "running": ("orchard_engine_running_sequences", "Sequences being generated."),
            "tps": ("orchard_engine_tokens_per_second", "Recent generation throughput."),
            "cache_bytes": ("orchard_prefix_cache_bytes", "Bytes held by the prefix cache."),
            "budget": ("orchard_engine_memory_budget_bytes", "The model's memory budget."),
        }
        families = {k: GaugeMetricFamily(n, h, labels=["model"]) for k, (n, h) in gauges.items()}
        lookups = CounterMetricFamily(
            "orchard_prefix_cache_lookups", "Prefix cache lookups.", labels=["model"]
        )
        hits = CounterMetricFamily(
            "orchard_prefix_cache_hits", "Prefix cache hits.", labels=["model"]
        )
        hit_tokens = CounterMetricFamily(
            "orchard_prefix_cache_hit_tokens",
            "Prompt tokens not recomputed thanks to the prefix cache.",
            labels=["model"],
        )
        tiers = self._tiers()
        drafted = CounterMetricFamily(
            "orchard_speculative_draft_tokens",
            "Draft tokens checked by speculative decoding.",
            labels=["model"],
        )
        accepted = CounterMetricFamily(
            "orchard_speculative_accepted_tokens",
            "Draft tokens speculative decoding accepted (each one a forward saved).",
            labels=["model"],
        )
        for stats in self.stats:
            cache = stats.prefix_cache or {}
            drafted.add_metric([stats.model], stats.num_draft_tokens)
            accepted.add_metric([stats.model], stats.num_accepted_draft_tokens)
            families["waiting"].add_metric([stats.model], stats.num_waiting)
            families["running"].add_metric([stats.model], stats.num_running)
            families["tps"].add_metric([stats.model], stats.tokens_per_second)
            families["cache_bytes"].add_metric([stats.model], cache.get("bytes", 0))
            families["budget"].add_metric([stats.model], stats.memory_budget_bytes)
            lookups.add_metric([stats.model], cache.get("lookups", 0))
            hits.add_metric([stats.model], cache.get("hits", 0))
            hit_tokens.add_metric([stats.model], cache.get("hit_tokens", 0))
            for key, family in tiers.items():
                family.add_metric([stats.model], cache.get(key, 0))
        yield from families.values()
        yield from (lookups, hits, hit_tokens, drafted, accepted)
        yield from tiers.values()
        yield from self._teams()

    @staticmethod
    def _tiers() -> dict:
        """The prefix cache's memory entries and its disk tier (engine/cache/disk/), by the key
        of its stats (PrefixCacheStats) each reads."""
        gauges = {
            "nodes": ("orchard_prefix_cache_entries", "Entries the prefix cache holds in memory."),
            "disk_entries": ("orchard_prefix_cache_disk_entries", "Files of the disk tier."),
            "disk_bytes": ("orchard_prefix_cache_disk_bytes", "Bytes of the disk tier's files."),
            "disk_max_bytes": (
                "orchard_prefix_cache_disk_max_bytes",
                "The disk tier's budget (0: no disk tier).",
            ),
        }
        counters = {
            "disk_lookups": "Lookups that memory could not serve in full, tried on disk.",
            "disk_hits": "Hits the disk tier made or lengthened.",
            "disk_hit_tokens": "Prompt tokens read back from disk instead of recomputed.",
            "disk_spills": "Entries written to disk (evicted from memory, or kept at unload).",
            "disk_spill_bytes": "Bytes written to disk.",
            "disk_spills_dropped": "Entries not written: the writer was behind, or stopped.",
            "disk_read_errors": "Files refused (corrupt, truncated, foreign) and deleted.",
            "disk_write_errors": "Writes that failed (a full disk, an unwritable folder).",
        }
        families = {
            key: GaugeMetricFamily(name, text, labels=["model"])
            for key, (name, text) in gauges.items()
        }
        for key, text in counters.items():
            name = f"orchard_prefix_cache_{key}"
            families[key] = CounterMetricFamily(name, text, labels=["model"])
        return families


# A model's place in the memory budget, as the metrics name its ModelStatus.state.
MODEL_STATES = {
    "not_loaded": "unloaded",
    "loading": "loading",
    "serving": "loaded",
    "failed": "failed",
    "stopped": "stopped",
    "draining": "draining",
}


class _ResidencyCollector:
    """Each registered model's state, memory, last use and pinning, and each worker's memory
    budget (engine/cache/host.py)."""

    def __init__(self, statuses: list[ModelStatus], budgets: Mapping[str, Mapping]):
        self.statuses = statuses
        self.budgets = budgets

    def collect(self):
        state = GaugeMetricFamily(
            "orchard_model_state",
            "1 for the model's state, 0 for the others.",
            labels=["model", "state"],
        )
        memory = GaugeMetricFamily(
            "orchard_model_memory_bytes",
            "Bytes the model holds in the memory budget (weights and its caches' budget).",
            labels=["model"],
        )
        last_used = GaugeMetricFamily(
            "orchard_model_last_used_timestamp_seconds",
            "Unix time of the model's last request.",
            labels=["model"],
        )
        pinned = GaugeMetricFamily(
            "orchard_model_pinned", "1 if the model is never unloaded.", labels=["model"]
        )
        for status in self.statuses:
            current = MODEL_STATES.get(status.state, status.state)
            for name in dict.fromkeys([*MODEL_STATES.values(), current]):
                state.add_metric([status.name, name], 1.0 if name == current else 0.0)
            memory.add_metric([status.name], status.memory_bytes)
            if status.last_used is not None:
                last_used.add_metric([status.name], status.last_used)
            pinned.add_metric([status.name], 1.0 if status.pinned else 0.0)
        budget = GaugeMetricFamily(
            "orchard_memory_budget_bytes",
            "The memory budget all of a worker's models share (absent: no budget).",
            labels=["worker"],
        )
        used = GaugeMetricFamily(
            "orchard_memory_used_bytes", "Bytes the worker's models hold in it.", labels=["worker"]
        )
        for worker, numbers in self.budgets.items():
            if numbers.get("max_bytes") is not None:
                budget.add_metric([worker], numbers["max_bytes"])
            used.add_metric([worker], numbers.get("used_bytes", 0))
        yield from (state, memory, last_used, pinned, budget, used)


def exposition(
    stats: list[EngineStats],
    teams: Mapping[str, str] | None = None,
    *,
    statuses: list[ModelStatus] = (),
    budgets: Mapping[str, Mapping] | None = None,
) -> bytes:
    """The text format Prometheus scrapes: this process's counts, then the engines' gauges
    (`teams`: team names by tenant, services/tenants.py), then the registered models' places
    in the memory budget (`statuses`) and the workers' budgets."""
    engines = CollectorRegistry(auto_describe=False)
    engines.register(_EngineCollector(stats, teams or {}))
    engines.register(_ResidencyCollector(list(statuses), budgets or {}))
    return generate_latest(REGISTRY) + generate_latest(engines)
