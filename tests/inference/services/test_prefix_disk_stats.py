"""Where the web side shows the prefix cache's two tiers: the model list's column and the model
page's statistics (memory and disk, each with its hit rate), /metrics, and the sum over remote
workers' beats (every disk field summed like the memory tier's)."""

import dataclasses

from django.contrib import admin

from engine import EngineStats, ModelStatus
from engine.cache.prefix import PrefixCacheStats
from inference.admin import registry
from inference.models import ModelEntry
from inference.services.metrics import _EngineCollector
from inference.workers.beats import ModelBeat, sum_stats

CACHE = PrefixCacheStats(
    lookups=10,
    hits=6,
    hit_tokens=900,
    nodes=3,
    bytes=50_000_000,
    max_bytes=200_000_000,
    evictions=4,
    evicted_bytes=80_000_000,
    disk_entries=12,
    disk_bytes=70_000_000,
    disk_max_bytes=4_000_000_000,
    disk_lookups=8,
    disk_hits=2,
    disk_hit_tokens=500,
    disk_spills=12,
    disk_spill_bytes=70_000_000,
    disk_read_errors=1,
    disk_spilling=1,
).to_dict()


class FakeClient:
    def __init__(self, cache):
        self.cache = cache

    def model_status(self, name):
        stats = EngineStats(model=name, prefix_cache=self.cache)
        return ModelStatus(name=name, state="serving", stats=stats)


def columns(monkeypatch, cache) -> tuple[str, str]:
    monkeypatch.setattr(registry, "get_engine_client", lambda: FakeClient(cache))
    model_admin = registry.ModelEntryAdmin(ModelEntry, admin.site)
    entry = ModelEntry(pk=1, name="m")
    return model_admin.cache(entry), model_admin.cache_stats(entry)


def test_the_admin_shows_each_tier_and_its_hit_rate(monkeypatch):
    column, statistics = columns(monkeypatch, CACHE)
    # Memory: 4 of 10 lookups hit there; disk: 2 of the 8 memory could not serve in full.
    assert column == "50.0 MB of 200.0 MB, 40% hits; disk 70.0 MB of 4,000.0 MB, 25% hits"
    assert "3 entries, 50.0 MB of 200.0 MB; 10 lookups, 4 hits, 400 prompt tokens" in statistics
    assert "Disk: 12 files, 70.0 MB of 4,000.0 MB; 8 lookups, 2 hits, 500 prompt tokens" in (
        statistics
    )
    assert "1 bad files, 0 write errors" in statistics and "stopped" not in statistics
    column, statistics = columns(monkeypatch, {**CACHE, "disk_spilling": 0})
    assert "stopped: a write failed" in statistics
    off = {k: v for k, v in CACHE.items() if not k.startswith("disk_")}
    column, statistics = columns(monkeypatch, off)
    assert column == "50.0 MB of 200.0 MB, 60% hits" and statistics.endswith("Disk: off.")


def test_metrics_show_the_disk_tier(monkeypatch):
    stats = EngineStats(model="m", prefix_cache=CACHE)
    families = {f.name: f for f in _EngineCollector([stats], {}).collect()}
    value = {name: family.samples[0].value for name, family in families.items() if family.samples}
    assert value["orchard_prefix_cache_entries"] == 3
    assert value["orchard_prefix_cache_disk_entries"] == 12
    assert value["orchard_prefix_cache_disk_bytes"] == 70_000_000
    assert value["orchard_prefix_cache_disk_max_bytes"] == 4_000_000_000
    assert value["orchard_prefix_cache_disk_lookups"] == 8
    assert value["orchard_prefix_cache_disk_hits"] == 2
    assert value["orchard_prefix_cache_disk_hit_tokens"] == 500
    assert value["orchard_prefix_cache_disk_spills"] == 12
    assert value["orchard_prefix_cache_disk_read_errors"] == 1
    assert value["orchard_prefix_cache_disk_write_errors"] == 0


def test_remote_workers_disk_tiers_are_summed():
    stats = EngineStats(model="m", prefix_cache=CACHE).to_dict()
    other = dataclasses.replace(
        EngineStats(model="m"), prefix_cache={**CACHE, "disk_hits": 5, "disk_bytes": 1}
    ).to_dict()
    beats = [ModelBeat(name="m", state="serving", stats=s) for s in (stats, other)]
    total = sum_stats("m", beats).prefix_cache
    assert total["disk_hits"] == 7 and total["disk_bytes"] == 70_000_001
    assert total["disk_entries"] == 24 and total["hits"] == 12
