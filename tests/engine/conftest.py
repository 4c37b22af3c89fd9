"""Shared engine fixtures: tiny float32 models (built once, cached on disk) and an engine driver."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable, Iterable

import pytest

from engine.cache.disk import PrefixDiskConfig
from engine.core.batched import BatchedEngine
from engine.core.loop import EngineLoop
from engine.core.simple import SimpleEngine
from engine.models.loader import LoadedModel, load_model
from engine.protocol import GenerationOutput, GenerationRequest, ModelSpec, SamplingParams
from tests.fixtures.tiny_models import build_tiny_model


@pytest.fixture(scope="session")
def tiny_llama() -> LoadedModel:
    return load_model(build_tiny_model(model_type="llama", tokenizer="qwen3"), name="tiny-llama")


@pytest.fixture(scope="session")
def tiny_qwen3_next() -> LoadedModel:
    return load_model(
        build_tiny_model(model_type="qwen3_next", tokenizer="qwen3"), name="tiny-next"
    )


@pytest.fixture(params=["llama", "qwen3_next"])
def tiny_model(request) -> LoadedModel:
    """Each identity test runs on a dense model and on a hybrid (ArraysCache + KVCache) one."""
    return request.getfixturevalue("tiny_llama" if request.param == "llama" else "tiny_qwen3_next")


async def eventually(
    predicate: Callable[[], Awaitable[bool] | bool],
    *,
    timeout: float = 10,  # noqa: ASYNC109
) -> None:
    """Wait until `predicate` holds: engine state lives on another thread, so tests poll it."""
    async with asyncio.timeout(timeout):
        while True:
            result = predicate()
            if await result if inspect.isawaitable(result) else result:
                return
            await asyncio.sleep(0.002)


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kwargs)


def make_request(
    request_id: str, prompt: Iterable[int], params: SamplingParams
) -> GenerationRequest:
    return GenerationRequest(request_id, "tiny", tuple(prompt), params)


def manual_engine(
    loaded: LoadedModel,
    engine_class: type[EngineLoop] = BatchedEngine,
    *,
    prefix_disk: PrefixDiskConfig | None = None,
    **spec_kwargs,
) -> EngineLoop:
    """An engine driven step by step on the test's thread (no engine thread): deterministic
    control of which step each request joins at. With `prefix_disk` (and the model's folder as
    `path`), its prefix cache has a disk tier."""
    spec = ModelSpec(**{"name": "tiny", "path": "unused", **spec_kwargs})
    engine = engine_class(spec, lambda: loaded)
    engine.prefix_disk = prefix_disk
    engine.loaded = loaded
    engine.ready.set_result(engine.serving_info(loaded.info))
    engine.setup()
    return engine


class Collector:
    """Gathers output events per (request id, choice index)."""

    def __init__(self) -> None:
        self.events: dict[tuple[str, int], list[GenerationOutput]] = {}

    def emit_for(self, request_id: str) -> Callable[[GenerationOutput], None]:
        def emit(output: GenerationOutput) -> None:
            self.events.setdefault((request_id, output.index), []).append(output)

        return emit

    def tokens(self, request_id: str, index: int = 0) -> list[int]:
        return [t for o in self.events[(request_id, index)] for t in o.token_ids]

    def text(self, request_id: str, index: int = 0) -> str:
        return "".join(o.text for o in self.events[(request_id, index)])

    def finish_reason(self, request_id: str, index: int = 0) -> str | None:
        return self.events[(request_id, index)][-1].finish_reason

    def cached(self, request_id: str, index: int = 0) -> int:
        """The prompt tokens the prefix cache provided (as the first output reports them)."""
        return self.events[(request_id, index)][0].num_cached_tokens


def run_batched(
    loaded: LoadedModel,
    requests: list[GenerationRequest],
    join_at: list[int] | None = None,
    **spec_kwargs,
) -> Collector:
    """Run requests on a manually stepped BatchedEngine; request i joins before step join_at[i]."""
    return drive(manual_engine(loaded, BatchedEngine, **spec_kwargs), requests, join_at)


def drive(
    engine: BatchedEngine, requests: list[GenerationRequest], join_at: list[int] | None = None
) -> Collector:
    """Step `engine` until `requests` (request i joining before step join_at[i]) are done."""
    collector = Collector()
    join_at = join_at or [0] * len(requests)
    step = 0
    pending = sorted(zip(join_at, range(len(requests)), strict=True))
    while pending or engine.scheduler.has_work():
        while pending and pending[0][0] <= step:
            request = requests[pending.pop(0)[1]]
            engine.scheduler.add(
                engine.make_request(request, collector.emit_for(request.request_id))
            )
        if engine.scheduler.has_work():
            engine.step()
        step += 1
    assert engine.runner.num_rows == 0
    return collector


def run_simple(
    loaded: LoadedModel, requests: list[GenerationRequest], engine: SimpleEngine | None = None
) -> Collector:
    engine = engine or manual_engine(loaded, SimpleEngine)
    collector = Collector()
    for request in requests:
        engine.generate(engine.make_request(request, collector.emit_for(request.request_id)))
    return collector
