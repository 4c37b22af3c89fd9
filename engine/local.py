"""LocalEngineClient: the engine in this process, behind the asyncio `EngineClient` interface.

Outputs cross from the engine thread into a per-request `asyncio.Queue`. Outputs for one event
loop are coalesced: while a delivery is pending, new ones join it, so a batch step wakes the loop
about once rather than once per token per sequence. Leaving the stream early (closing the
iterator, or cancelling the task that consumes it) sends an abort, which the engine applies
before its next step.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import threading
import weakref
from collections.abc import AsyncIterator

import numpy as np
from jinja2 import TemplateError

from engine.client import EngineClient
from engine.embeddings import Embedders, EmbeddingInfo
from engine.loop import describe
from engine.protocol import (
    EngineStats,
    GenerationOutput,
    GenerationRequest,
    InvalidRequestError,
    ModelInfo,
    ModelNotLoadedError,
    ModelSpec,
    ModelStatus,
    PromptInput,
    RenderedPrompt,
)
from engine.templates import ERROR_TIMEOUT, apply_chat_template, with_deadline
from engine.worker import EngineWorker

logger = logging.getLogger(__name__)


class _LoopMailbox:
    """Outputs posted from engine threads to one event loop, delivered in batches."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._lock = threading.Lock()
        self._pending: list[tuple[asyncio.Queue, GenerationOutput]] = []

    def post(self, queue: asyncio.Queue, output: GenerationOutput) -> None:
        with self._lock:
            self._pending.append((queue, output))
            if len(self._pending) > 1:
                return  # a delivery is already scheduled and will take this one too
        try:
            self._loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:
            pass  # the event loop is closed: nobody is listening any more

    def _deliver(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        for queue, output in pending:
            queue.put_nowait(output)


# Prompts render on threads of their own, so a burst of slow renders never holds the threads
# the rest of the process runs blocking work on.
RENDER_THREADS = 4


class LocalEngineClient(EngineClient):
    def __init__(self, worker: EngineWorker | None = None):
        self.embedders = Embedders()
        self.worker = worker or EngineWorker()
        self._render_pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=RENDER_THREADS, thread_name_prefix="orchard-render"
        )
        self._mailboxes: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopMailbox] = (
            weakref.WeakKeyDictionary()
        )

    def _mailbox(self, loop: asyncio.AbstractEventLoop) -> _LoopMailbox:
        mailbox = self._mailboxes.get(loop)
        if mailbox is None:
            mailbox = self._mailboxes[loop] = _LoopMailbox(loop)
        return mailbox

    async def ensure_model(self, spec: ModelSpec) -> ModelInfo:
        # `load` never waits for an engine thread (a replaced engine drains on its own), so it
        # is safe on the event loop.
        return await asyncio.wrap_future(self.worker.load(spec))

    async def serving_model(self, spec: ModelSpec) -> ModelInfo:
        return await asyncio.wrap_future(self.worker.serve(spec))

    def model_status(self, name: str) -> ModelStatus:
        return self.worker.status(name)

    def clear_prefix_cache(self, name: str, timeout: float = 30.0) -> int:
        try:
            engine = self.worker.get(name)
        except ModelNotLoadedError:
            return 0
        return engine.clear_prefix_cache().result(timeout)

    def start_loading(self, spec: ModelSpec, *, force: bool = False) -> None:
        def report(future: concurrent.futures.Future) -> None:
            if not future.cancelled() and future.exception() is not None:
                logger.error("model %s could not be loaded: %s", spec.name, future.exception())

        self.worker.load(spec, force=force).add_done_callback(report)

    async def unload_model(self, name: str) -> None:
        await asyncio.to_thread(self.worker.unload, name)

    async def render_prompt(
        self, model: str, prompt: PromptInput, *, timeout_s: float | None = None
    ) -> RenderedPrompt:
        engine = self.worker.get(model)
        tokenizer, checkpoints = engine.loaded.tokenizer, engine.info.hybrid
        # Tokenizers and templates only: no MLX off the engine thread.
        loop = asyncio.get_running_loop()
        work = functools.partial(_render, tokenizer, prompt, checkpoints=checkpoints)
        if timeout_s is None:
            return await loop.run_in_executor(self._render_pool, work)
        param = "messages" if prompt.messages is not None else "prompt"
        render = loop.run_in_executor(
            self._render_pool, functools.partial(with_deadline, work, timeout_s, param=param)
        )
        try:
            # The deadline stops Python code; this stops waiting for C code that runs on.
            return await asyncio.wait_for(asyncio.shield(render), timeout_s + 1.0)
        except TimeoutError:
            raise InvalidRequestError(
                ERROR_TIMEOUT.format(seconds=timeout_s), param=param
            ) from None

    async def detokenize(self, model: str, token_ids: list[int]) -> str:
        tokenizer = self.worker.get(model).loaded.tokenizer
        return await asyncio.to_thread(tokenizer.decode, list(token_ids))

    def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationOutput]:
        return self._generate(request)

    async def _generate(self, request: GenerationRequest) -> AsyncIterator[GenerationOutput]:
        mailbox = self._mailbox(asyncio.get_running_loop())
        outputs: asyncio.Queue[GenerationOutput] = asyncio.Queue()

        def emit(output: GenerationOutput) -> None:
            mailbox.post(outputs, output)

        if request.sampling.grammar is not None:
            await asyncio.to_thread(
                self.worker.compile_grammar, request.model, request.sampling.grammar
            )
        self.worker.submit(request, emit)
        num_open = request.sampling.n
        try:
            while num_open:
                output = await outputs.get()
                if output.finish_reason is not None:
                    num_open -= 1
                yield output
        finally:
            if num_open:
                self.worker.abort(request.model, request.request_id)

    async def abort(self, request_id: str) -> None:
        for name in self.worker.model_names():
            self.worker.abort(name, request_id)

    async def stats(self) -> list[EngineStats]:
        return self.worker.stats()

    async def shutdown(self) -> None:
        await asyncio.to_thread(self.close)

    def close(self, timeout: float | None = None) -> None:
        """`shutdown` for callers without an event loop (an atexit hook): abort everything in
        flight and join each engine thread, waiting at most `timeout` seconds for each."""
        self.worker.shutdown(timeout)
        self._render_pool.shutdown(wait=False, cancel_futures=True)
        self.embedders.stop()

    async def embedding_model(self, name: str, path: str) -> EmbeddingInfo:
        return (await asyncio.to_thread(self.embedders.get, name, path)).info

    async def tokenize_texts(self, name: str, texts: list[str]) -> list[list[int]]:
        return await asyncio.to_thread(self.embedders.running(name).tokenize, texts)

    async def embed(self, name: str, token_ids: list[list[int]]) -> np.ndarray:
        return await asyncio.wrap_future(self.embedders.running(name).submit(token_ids))


# Tokens at the end of a chat prompt decoded for `RenderedPrompt.tail_text`.
TAIL_TOKENS = 8


def _render(tokenizer, prompt: PromptInput, *, checkpoints: bool = False) -> RenderedPrompt:
    if prompt.token_ids is not None:
        return RenderedPrompt(tuple(prompt.token_ids))
    if prompt.messages is not None:
        try:
            ids = _chat(tokenizer, prompt, prompt.messages, prompt.add_generation_prompt)
            tail = tokenizer.decode(ids[-TAIL_TOKENS:]) if ids else ""
            points = _checkpoints(tokenizer, prompt, ids) if checkpoints else ()
            return RenderedPrompt(tuple(ids), points, tail_text=tail)
        except InvalidRequestError:
            raise
        except Exception as exc:
            # Templates raise on conversations they cannot render (roles out of order, a range
            # too large, recursion over a deep tool schema, ...): the caller's input, a 400.
            if not isinstance(exc, ValueError | TypeError | TemplateError):
                logger.warning("chat template failed with %s", describe(exc))
            raise InvalidRequestError(
                f"The messages could not be rendered by the chat template: {exc}", param="messages"
            ) from exc
    if prompt.text is not None:
        return RenderedPrompt(tuple(tokenizer.encode(prompt.text)))
    raise InvalidRequestError("A prompt needs messages, text or token ids.", param="prompt")


def _chat(tokenizer, prompt: PromptInput, messages, add_generation_prompt: bool) -> list[int]:
    return apply_chat_template(
        tokenizer,
        messages,
        tools=prompt.tools,
        add_generation_prompt=add_generation_prompt,
        chat_template_kwargs=prompt.chat_template_kwargs,
    )


def _checkpoints(tokenizer, prompt: PromptInput, ids: list[int]) -> tuple[int, ...]:
    """Where a later request is likely to resume: after the system messages (and the tools the
    template puts there), and after the conversation before the last user turn.

    Rendering those messages alone would not do: templates render a conversation's last
    message differently (Qwen3 gives a final assistant turn an empty think block). So each
    boundary is where the prompt parts from the same conversation cut there and followed by
    an empty user turn: both have the same shape up to the new turn's text."""
    messages = prompt.messages
    num_system = next(
        (i for i, m in enumerate(messages) if m.get("role") != "system"), len(messages)
    )
    last_user = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=0)
    points = set()
    for end in {num_system, last_user}:
        if 0 < end < len(messages):
            variant = [*messages[:end], {"role": "user", "content": ""}]
            other = _chat(tokenizer, prompt, variant, add_generation_prompt=False)
            common = next(
                (i for i, (a, b) in enumerate(zip(ids, other, strict=False)) if a != b),
                min(len(ids), len(other)),
            )
            if 0 < common < len(ids) - 1:
                points.add(common)
    return tuple(sorted(points))
