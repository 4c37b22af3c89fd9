"""The one interface through which the web side talks to the engine.

`LocalEngineClient` (engine/local.py) runs the worker in this process; `RemoteEngineClient`
(inference/workers/) reaches `runengine` workers over the Channels layer. Everything the web
side asks of a running engine is a method here, implemented by both: generation, embeddings,
rendering and tokenizing, and the models' facts and status. The API never touches schedulers or
MLX.
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from engine.protocol import (
    EmbeddingInfo,
    EmbeddingProgress,
    EngineStats,
    GenerationOutput,
    GenerationRequest,
    ModelInfo,
    ModelSpec,
    ModelStatus,
    PromptInput,
    PromptRoom,
    RenderedPrompt,
)

if TYPE_CHECKING:
    import numpy as np


class EngineClient(abc.ABC):
    @abc.abstractmethod
    async def ensure_model(self, spec: ModelSpec) -> ModelInfo:
        """Load the model if it is not loaded (or reload it if its spec changed); return its
        info."""

    @abc.abstractmethod
    async def serving_model(self, spec: ModelSpec) -> ModelInfo:
        """The info of the engine a request for `spec.name` will run on, never waiting for a
        reload: while an engine serves the name its info comes at once (and a changed `spec`
        starts loading beside it); only a name nothing serves yet waits for its load. Raises
        ModelLoadError when `spec` failed to load recently and nothing else serves the name."""

    @abc.abstractmethod
    def model_status(self, name: str) -> ModelStatus:
        """Where a model stands (serving, loading, its last load error, its engine's stats with
        the prefix cache's), without waiting."""

    @abc.abstractmethod
    def clear_prefix_cache(self, name: str, timeout: float = 30.0) -> int:
        """Empty a model's prefix cache and return its memory to the system; the bytes freed
        (0 when the model is not loaded). Waits at most `timeout` seconds for its engine."""

    @abc.abstractmethod
    def start_loading(self, spec: ModelSpec, *, force: bool = False) -> None:
        """Begin loading a model without waiting (at web-process start, or an admin's reload,
        which retries a failed load at once); a later `ensure_model` for the same spec waits
        for this load instead of starting another. `force` loads a fresh engine even when the
        spec already serves (its files changed on disk)."""

    @abc.abstractmethod
    def place_models(self, specs: list[ModelSpec], *, load_new: bool = True) -> None:
        """Follow the registry without waiting: `specs` are the enabled models. A changed spec
        loads beside the serving one, a name no longer listed stops once what it runs has
        finished, and (with `load_new`) a listed name nothing serves starts loading."""

    @abc.abstractmethod
    def memory_budgets(self) -> dict[str, dict[str, int | None]]:
        """Per engine worker ("local" for the in-process one): its memory budget's max_bytes
        (None: none) and the used_bytes its models hold."""

    @abc.abstractmethod
    async def unload_model(self, name: str, *, drain: bool = False) -> None:
        """Stop serving a model (it loads again on its next request): its in-flight requests
        end with finish_reason "abort", or with `drain` finish first while it takes no new
        ones (remote workers always drain)."""

    @abc.abstractmethod
    async def render_prompt(
        self,
        model: str,
        prompt: PromptInput,
        *,
        timeout_s: float | None = None,
        room: PromptRoom | None = None,
    ) -> RenderedPrompt:
        """Token ids for a prompt: chat messages through the model's chat template (with `tools`
        and `chat_template_kwargs`, whose server-owned keys are refused), text through the
        tokenizer, or token ids as they are; for a chat on a hybrid model, also its checkpoints.
        A render running past `timeout_s` is stopped (its work ends) with InvalidRequestError.
        With `room`, a text prompt that leaves too little of the context is refused where it
        is tokenized (InvalidRequestError, context_length_exceeded)."""

    @abc.abstractmethod
    async def detokenize(self, model: str, token_ids: list[int]) -> str:
        """Text for token ids (used for `echo`)."""

    @abc.abstractmethod
    def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationOutput]:
        """Stream outputs for a request. Validation errors and overload are raised before the
        first output. Closing the iterator early (or cancelling the task consuming it) aborts
        the request in the engine, freeing its slot within one engine step."""

    @abc.abstractmethod
    async def embedding_model(self, spec: ModelSpec) -> EmbeddingInfo:
        """The info of the embedding model `spec` names, loading it if nothing serves it yet;
        ModelLoadError (EmbeddingLoadError) when it cannot be loaded."""

    @abc.abstractmethod
    async def tokenize(
        self, model: str, texts: list[str], *, timeout_s: float | None = None
    ) -> list[list[int]]:
        """Each text's token ids by an embedding model's tokenizer (its special tokens
        included, cut at nothing: the caller checks them against the model's context). A
        tokenizing running past `timeout_s` is stopped with InvalidRequestError."""

    @abc.abstractmethod
    async def embed(
        self,
        model: str,
        token_ids: list[list[int]],
        progress: EmbeddingProgress | None = None,
    ) -> np.ndarray:
        """The (inputs, dimensions) float32 vectors of an embedding model for token ids it has
        checked; concurrent calls share the model's forwards. Cancelling the task awaiting it
        stops the call between forwards; `progress`, when given, holds the tokens computed once
        this has returned or raised."""

    @abc.abstractmethod
    async def abort(self, request_id: str) -> None:
        """Abort a request by id (a no-op when it has finished)."""

    @abc.abstractmethod
    async def stats(self) -> list[EngineStats]:
        """Per-model queue depth, running count, throughput and step time."""

    @abc.abstractmethod
    async def shutdown(self) -> None:
        """Abort everything in flight and stop the engine threads."""
