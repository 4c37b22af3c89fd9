"""Orchard's MLX engine, and its one public face: the web side imports the engine only from here.

The rooms behind it (docs/architecture.md walks through them):
- protocol/: the plain data that crosses to the web side (requests, outputs, model facts, errors);
- client.py: `EngineClient`, the interface the web side calls; local.py runs it in this process,
  worker.py owns the loaded models (also what a `runengine` process serves);
- core/: request state, the scheduler, the loop, the engines and the runners (the model calls);
- cache/: mlx-lm's cache objects, the prefix cache and its disk tier, the memory budget;
- models/: loading, model folders' facts, GGUF conversion, embedding models, pulls from the
  Hugging Face hub (hub.py, pull.py) and checkpoint conversion (convert.py);
- text/: chat templates, rendering, detokenizing, harmony, grammars;
- kernels/: fast CPU kernels, the BLAS and Orchard's native code.

No module of the engine imports Django or the apps (`make test` checks this and the rest of the
layering with import-linter). Importing this package loads a fast BLAS first on Linux
(kernels/blas.py), so that MLX's CPU backend uses it; the protocol and the client interface
load at once, everything that needs MLX or a tokenizer library on first use of its name.
"""

from __future__ import annotations

import importlib
from typing import Any

from engine.kernels.blas import preload_blas

preload_blas()

# isort: split
from engine.client import EngineClient  # noqa: E402
from engine.protocol import (  # noqa: E402
    SERVICE_TIERS,
    EmbeddingInfo,
    EmbeddingLoadError,
    EmbeddingProgress,
    EngineError,
    EngineOverloadedError,
    EngineStats,
    GenerationOutput,
    GenerationRequest,
    InvalidRequestError,
    ModelCapacityError,
    ModelInfo,
    ModelLoadError,
    ModelNotLoadedError,
    ModelSpec,
    ModelStatus,
    ModelUnavailableError,
    PromptImage,
    PromptInput,
    PromptRoom,
    RenderedPrompt,
    RequestStatus,
    SamplingParams,
    ServiceClass,
    TokenLogprob,
    TopLogprob,
    completion_budget,
    validate_generation,
)

# Names loaded on first use (they import MLX, mlx-lm or a tokenizer library): name -> module.
_LAZY = {
    "LocalEngineClient": "engine.local",
    "EmbeddingJob": "engine.core.embedding",
    "EngineWorker": "engine.worker",
    "host_memory": "engine.cache.memory",
    "PrefixDiskConfig": "engine.cache.disk",
    "DEFAULT_EMBEDDING_MODEL": "engine.models.embeddings",
    "default_embedding_folder": "engine.models.embeddings",
    "convert_gguf": "engine.models.gguf",
    "GROUP_SIZES": "engine.models.convert",
    "QUANTIZE_BITS": "engine.models.convert",
    "PullAbandoned": "engine.models.pull",
    "PulledModel": "engine.models.pull",
    "PullError": "engine.models.hub",
    "PullRequest": "engine.models.pull",
    "PullStopped": "engine.models.hub",
    "format_bytes": "engine.models.pull",
    "parse_source": "engine.models.hub",
    "pull_model": "engine.models.pull",
    "default_gguf_path": "engine.models.gguf",
    "load_tokenizer": "engine.models.loader",
    "folder_context_length": "engine.models.config",
    "folder_embedding_context_length": "engine.models.config",
    "folder_facts": "engine.models.config",
    "PromptRenderer": "engine.text.rendering",
    "TokenizerProcesses": "engine.text.processes",
    "PoolSize": "engine.text.processes",
    "expand_rendered": "engine.models.vision",
    "check_template_kwargs": "engine.text.templates",
    "harmony_encoding": "engine.text.harmony",
}

__all__ = [
    "EmbeddingInfo",
    "EmbeddingLoadError",
    "EmbeddingProgress",
    "EngineClient",
    "EngineError",
    "EngineOverloadedError",
    "EngineStats",
    "GenerationOutput",
    "GenerationRequest",
    "PromptImage",
    "InvalidRequestError",
    "ModelInfo",
    "ModelLoadError",
    "ModelNotLoadedError",
    "ModelSpec",
    "ModelStatus",
    "ModelCapacityError",
    "ModelUnavailableError",
    "PromptInput",
    "RenderedPrompt",
    "RequestStatus",
    "SamplingParams",
    "SERVICE_TIERS",
    "ServiceClass",
    "TokenLogprob",
    "TopLogprob",
    "PromptRoom",
    "PoolSize",
    "completion_budget",
    "validate_generation",
    *sorted(_LAZY),
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
