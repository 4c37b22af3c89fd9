"""Load a model folder: mlx-lm's loader, with a transformers fallback for the tokenizer.

Every path returns its result (a past refactor returned only from `except` branches, so clean
loads produced None). Tokenizer-only helpers here run off the engine thread: they never touch MLX.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import engine  # noqa: F401  (OpenBLAS before mlx)

# isort: split
import mlx.nn as nn
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.utils import load_model as mlx_load_model
from mlx_lm.utils import load_tokenizer as mlx_load_tokenizer
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from engine.kernels import fast as kernels
from engine.models.config import context_length as config_context_length
from engine.models.vision import VisionEncoder, is_vision_model, load_vision_model, read_config
from engine.protocol import ModelInfo
from engine.text.harmony import is_harmony_tokenizer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadedModel:
    model: nn.Module
    tokenizer: TokenizerWrapper
    config: Mapping[str, Any]
    info: ModelInfo
    tokenizer_source: str  # "mlx_lm" | "auto_tokenizer" | "tokenizer_file"
    # A vision-language model's image encoder (engine/models/vision.py); None: text only.
    vision: VisionEncoder | None = None


def load_model(
    path: str | Path, *, name: str | None = None, context_length: int | None = None
) -> LoadedModel:
    """Load weights with mlx-lm and the tokenizer by the first loader that works; on the CPU the
    model's MLPs, attention and rotary embeddings get the fast kernels (engine/kernels/) unless
    ORCHARD_FAST_KERNELS=0."""
    path = Path(path)
    vision = None
    config = read_config(path)
    if is_vision_model(config):  # mlx-vlm's encoder, the language model as mlx-lm's
        model, vision = load_vision_model(path, config)
    else:
        model, config = mlx_load_model(path)
    context = context_length or config_context_length(config)
    if kernels.fast_kernels_enabled():
        changed = kernels.install(model, positions=context)
        logger.info("%s: fast CPU kernels in %d modules", path.name, changed)
    else:  # attention that reads a batch's length cohorts (engine/cache/cohorts.py)
        kernels.install(model, fast=False)
    eos = config.get("eos_token_id")
    tokenizer, source = load_tokenizer(path, eos_token_ids=[eos] if isinstance(eos, int) else eos)
    info = ModelInfo(
        name=name or path.name,
        context_length=context,
        vocab_size=_vocab_size(model, config),
        eos_token_ids=tuple(sorted(tokenizer.eos_token_ids)),
        supports_tools=bool(getattr(tokenizer, "has_tool_calling", False)),
        chat_template=chat_template_text(tokenizer)
        or (HARMONY_TEMPLATE if is_harmony_tokenizer(tokenizer) else ""),
        added_tokens=_added_tokens(tokenizer),
        input_kinds=("text", "image") if vision is not None else ("text",),
    )
    return LoadedModel(model, tokenizer, config, info, source, vision)


def _added_tokens(tokenizer: TokenizerWrapper) -> dict[str, int]:
    try:
        return dict(tokenizer._tokenizer.get_added_vocab())
    except Exception:  # a tokenizer without added tokens, or not a transformers one
        return {}


def load_tokenizer(
    path: Path, *, eos_token_ids: Sequence[int] | None = None
) -> tuple[TokenizerWrapper, str]:
    try:
        return mlx_load_tokenizer(path, eos_token_ids=eos_token_ids), "mlx_lm"
    except Exception as exc:
        logger.warning(
            "mlx-lm could not load the tokenizer of %s (%s); trying transformers", path, exc
        )
    try:
        hf_tokenizer = AutoTokenizer.from_pretrained(str(path))
        source = "auto_tokenizer"
    except Exception as exc:
        logger.warning(
            "AutoTokenizer failed for %s (%s); reading tokenizer.json directly", path, exc
        )
        hf_tokenizer = _tokenizer_from_file(path)
        source = "tokenizer_file"
    return TokenizerWrapper(hf_tokenizer, eos_token_ids=eos_token_ids), source


def _tokenizer_from_file(path: Path) -> PreTrainedTokenizerFast:
    config_file = path / "tokenizer_config.json"
    config = json.loads(config_file.read_text()) if config_file.exists() else {}
    special = {
        key: config[key]
        for key in ("bos_token", "eos_token", "pad_token", "unk_token")
        if isinstance(config.get(key), str)
    }
    return PreTrainedTokenizerFast(
        tokenizer_file=str(path / "tokenizer.json"),
        chat_template=config.get("chat_template"),
        **special,
    )


def _vocab_size(model: nn.Module, config: Mapping[str, Any]) -> int:
    vocab = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    if vocab:
        return int(vocab)
    return int(model.model.embed_tokens.weight.shape[0])


# What ModelInfo.chat_template says of a gpt-oss tokenizer without a template (rendered by
# openai-harmony, engine/text/harmony.py): harmony's own markers, so the parsers are detected.
HARMONY_TEMPLATE = "{# rendered by openai-harmony: <|start|>role<|channel|>…<|message|>… #}"


def chat_template_text(tokenizer) -> str:
    """The tokenizer's chat template source ("" if it has none); named templates joined."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, str):
        return template
    if isinstance(template, dict):
        return "\n".join(t for t in template.values() if isinstance(t, str))
    if isinstance(template, list):  # [{"name": ..., "template": ...}]
        return "\n".join(t.get("template", "") for t in template if isinstance(t, dict))
    return ""
