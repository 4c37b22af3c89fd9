"""Operations with a reply on one engine worker (`call` on the wire): rendering and detokenizing
where this web host cannot read the model's tokenizer (where it can, they run here, no round
trip), tokenizing and embedding for an embedding model, emptying a prefix cache.

A call's result comes back as a `res` event on the process's reply channel (replies.py), where a
dead worker's calls also end, with ModelNotLoadedError. Vectors cross as float32 bytes (msgpack
carries bytes), a fraction of the size of a list of numbers.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np

from engine import (
    EmbeddingProgress,
    ModelInfo,
    ModelSpec,
    ModelUnavailableError,
    PoolSize,
    PromptInput,
    PromptRenderer,
    PromptRoom,
    RenderedPrompt,
)
from inference.workers.fleet import Fleet, Worker
from inference.workers.replies import Call, Replies
from inference.workers.wire import decode_error, worker_channel

logger = logging.getLogger(__name__)

CALL_TIMEOUT_S = 30.0
# An embedding call runs the model: a full batch on a busy worker takes a while. A dead worker
# ends it sooner (its beats stop); this bounds a reply the channel layer lost.
EMBED_TIMEOUT_S = 120.0
# A cancelled embedding ends at the end of its worker's forward under way: a second or so.
EMBED_STOP_WAIT_S = 10.0


class WorkerCalls:
    """Calls for one web process: `send` puts a message on a worker's channel."""

    def __init__(
        self,
        *,
        namespace: str,
        fleet: Fleet,
        replies: Replies,
        send: Callable[[str, dict], Awaitable[None]],
        render: PoolSize | None = None,
    ):
        self.namespace = namespace
        self.fleet = fleet
        self.replies = replies
        self.send = send
        self.renderer = PromptRenderer(render)
        self._tokenizers: dict[tuple[str, int], Any] = {}

    async def call(self, worker: Worker, op: str, args: dict, timeout_s: float = CALL_TIMEOUT_S):
        call_id = secrets.token_hex(8)
        future = asyncio.get_running_loop().create_future()
        self.replies.calls[call_id] = Call(future, worker.beat.worker_id, args.get("model"))
        try:
            await self.send(
                worker_channel(self.namespace, worker.beat.worker_id),
                {
                    "type": "call",
                    "op": op,
                    "args": args,
                    "reply": self.replies.channel,
                    "call_id": call_id,
                },
            )
            result = await asyncio.wait_for(future, timeout_s)
        finally:
            self.replies.calls.pop(call_id, None)
        if "error" in result:
            raise decode_error(result["error"])
        return result["value"]

    # Prompts
    async def render(
        self,
        model: str,
        prompt: PromptInput,
        timeout_s: float | None,
        room: PromptRoom | None = None,
    ) -> RenderedPrompt:
        worker, info = await self.fleet.any_serving(model)
        spec = worker.beat.models[model].model_spec()
        tokenizer = await self._tokenizer(spec, info)
        if tokenizer is not None and not prompt.images:  # images: the worker's processor
            return await self.renderer.render(
                tokenizer, prompt, checkpoints=info.hybrid, timeout_s=timeout_s, room=room
            )
        args = {"model": model, "prompt": prompt.to_dict(), "timeout_s": timeout_s}
        if room is not None:
            args["room"] = dataclasses.asdict(room)
        value = await self.call(worker, "render", args, (timeout_s or CALL_TIMEOUT_S) + 2)
        return RenderedPrompt(
            tuple(value["token_ids"]),
            tuple(value["checkpoints"]),
            value["tail_text"],
            tuple(value.get("image_tokens", ())),
        )

    async def detokenize(self, model: str, token_ids: list[int]) -> str:
        worker, info = await self.fleet.any_serving(model)
        tokenizer = await self._tokenizer(worker.beat.models[model].model_spec(), info)
        if tokenizer is not None:
            return await asyncio.to_thread(tokenizer.decode, list(token_ids))
        return await self.call(worker, "detokenize", {"model": model, "token_ids": token_ids})

    async def _tokenizer(self, spec: ModelSpec, info: ModelInfo):
        """The model's tokenizer read here, or None when this host cannot read its files."""
        folder = Path(spec.path)
        marker = next(
            (
                folder / n
                for n in ("tokenizer.json", "tokenizer_config.json")
                if (folder / n).is_file()
            ),
            None,
        )
        if marker is None:
            return None
        key = (str(folder), marker.stat().st_mtime_ns)
        if key not in self._tokenizers:
            self._tokenizers[key] = await asyncio.to_thread(_load_tokenizer, folder, info)
        return self._tokenizers[key]

    # Embeddings
    async def tokenize(
        self, model: str, texts: list[str], timeout_s: float | None
    ) -> list[list[int]]:
        worker = self._embedder(model)
        args = {"model": model, "texts": texts, "timeout_s": timeout_s}
        return await self.call(worker, "tokenize", args, (timeout_s or CALL_TIMEOUT_S) + 2)

    async def embed(
        self, model: str, token_ids: list[list[int]], progress: EmbeddingProgress | None
    ) -> np.ndarray:
        worker = self._embedder(model)
        request_id = secrets.token_hex(8)  # what an abort names
        args = {"model": model, "token_ids": token_ids, "request_id": request_id}
        reply = asyncio.ensure_future(self.call(worker, "embed", args, EMBED_TIMEOUT_S))
        try:
            value = await asyncio.shield(reply)
        except asyncio.CancelledError:
            value = await self._stop_embedding(worker, model, request_id, reply)
            if progress is not None:
                progress.num_computed_tokens = value.get("num_computed_tokens", 0)
            raise
        if progress is not None:
            progress.num_computed_tokens = value["num_computed_tokens"]
        return np.frombuffer(value["vectors"], dtype="<f4").reshape(value["shape"])

    async def _stop_embedding(
        self, worker: Worker, model: str, request_id: str, reply: asyncio.Future
    ) -> dict:
        """Its caller gave up: the worker stops the embedding between forwards and answers with
        the tokens it computed (its reply; {} when none came within EMBED_STOP_WAIT_S)."""
        if not reply.done():
            abort = {"type": "abort", "model": model, "request_id": request_id}
            try:
                await self.send(worker_channel(self.namespace, worker.beat.worker_id), abort)
            except Exception:
                logger.warning("could not stop embedding %s on its worker", request_id)
            await asyncio.wait([reply], timeout=EMBED_STOP_WAIT_S)
        if not reply.done():
            reply.cancel()
            return {}
        if reply.cancelled() or reply.exception() is not None:
            return {}  # a dead worker, say: what it computed is unknown
        return reply.result()

    def _embedder(self, model: str) -> Worker:
        """The least loaded worker serving the embedding model (no prefix to follow)."""
        worker = self.fleet.route(
            model, set(), (), reply=self.replies.channel, in_flight=self.replies.in_flight
        )
        if worker is None:
            raise ModelUnavailableError(
                f"No engine worker serves the model '{model}' now; please retry shortly."
            )
        return worker

    # Caches
    async def clear_prefix_cache(self, model: str, timeout_s: float) -> int:
        workers = self.fleet.serving(model)
        results = await asyncio.gather(
            *(self.call(w, "clear_cache", {"model": model}, timeout_s) for w in workers),
            return_exceptions=True,
        )
        return sum(r for r in results if isinstance(r, int))


def _load_tokenizer(folder: Path, info: ModelInfo):
    from engine import load_tokenizer

    try:
        return load_tokenizer(folder, eos_token_ids=list(info.eos_token_ids))[0]
    except Exception as exc:
        logger.warning("cannot read the tokenizer at %s here (%s); workers render", folder, exc)
        return None
