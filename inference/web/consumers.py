"""The live engine status over a Channels websocket (`/ws/status/`): every second, per model a
signed-in user may use (staff: every model), its queue, running sequences, tokens/s and prefix
cache; for staff also each team's share of each engine (`teams`). Anonymous sockets are closed
(4401) before anything is sent; the origin must be one of
ALLOWED_HOSTS (config/asgi.py)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from asgiref.sync import sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer

from accounts.models import ApiKey
from inference.services.engines import get_engine_client
from inference.services.registry import models_for_key
from inference.services.tenants import tenant_labels

INTERVAL_S = 1.0


def _allowed_models(user) -> set[str] | None:
    """Names the user may see; None: all (staff)."""
    if user.is_staff:
        return None
    names: set[str] = set()
    for key in ApiKey.objects.active().filter(user=user):
        names |= {entry.name for entry in models_for_key(key)}
    return names


def team_shares(stats, previous: dict, elapsed_s: float, labels: dict[str, str]) -> list[dict]:
    """Each team's share of each model's engine (engine/core/fairness.py) for staff: its
    requests waiting, rows running, and generated tokens per second since `previous` (the
    totals of the last call, updated here) with its share of the model's."""
    rows = []
    for entry in stats:
        rates = {}
        for tenant, counts in entry.tenants.items():
            key = (entry.model, tenant)
            total = counts.get("decode_tokens", 0)
            before = previous.get(key, total)
            previous[key] = total
            rates[tenant] = max(0, total - before) / elapsed_s if elapsed_s > 0 else 0.0
        overall = sum(rates.values())
        for tenant, counts in sorted(entry.tenants.items()):
            if not (counts.get("waiting") or counts.get("running") or rates[tenant]):
                continue
            rows.append(
                {
                    "model": entry.model,
                    "team": labels.get(tenant, tenant),
                    "waiting": counts.get("waiting", 0),
                    "running": counts.get("running", 0),
                    "tokens_per_second": round(rates[tenant], 1),
                    "share": round(rates[tenant] / overall, 3) if overall else 0.0,
                }
            )
    return rows


def status_payload(stats, allowed: set[str] | None) -> dict[str, Any]:
    models = []
    for entry in stats:
        if allowed is not None and entry.model not in allowed:
            continue
        cache = entry.prefix_cache or {}
        models.append(
            {
                "model": entry.model,
                "waiting": entry.num_waiting,
                "running": entry.num_running,
                "tokens_per_second": round(entry.tokens_per_second, 1),
                "cache_bytes": cache.get("bytes", 0),
                "cache_max": cache.get("max_bytes", 0),
            }
        )
    return {"models": models}


class StatusConsumer(AsyncJsonWebsocketConsumer):
    async def connect(self) -> None:
        user = self.scope.get("user")
        if user is None or not user.is_authenticated:
            await self.close(code=4401)
            return
        self.allowed = await sync_to_async(_allowed_models)(user)
        await self.accept()
        self.sender = asyncio.create_task(self._send_forever())

    async def disconnect(self, code: int) -> None:
        sender = getattr(self, "sender", None)
        if sender is not None:
            sender.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sender

    async def _send_forever(self) -> None:
        client = get_engine_client()
        previous: dict = {}
        last = time.monotonic()
        while True:
            stats = await client.stats()
            payload = status_payload(stats, self.allowed)
            if self.allowed is None:  # staff: every team's share
                now = time.monotonic()
                tenants = {tenant for entry in stats for tenant in entry.tenants}
                labels = await sync_to_async(tenant_labels)(tenants) if tenants else {}
                payload["teams"] = team_shares(stats, previous, now - last, labels)
                last = now
            await self.send_json(payload)
            await asyncio.sleep(INTERVAL_S)
