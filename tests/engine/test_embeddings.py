"""The MLX sentence encoder (engine/models/embeddings.py) on the real all-MiniLM-L6-v2: equal to an
independent NumPy BERT to 1e-4 (with engine/kernels' GELU and attention, and with MLX's own),
padded batches equal to one input at a time, similar sentences
closer than unrelated ones, folders that are not an encoder refused (the engine that serves one:
test_embedding_engine.py)."""

import json
from pathlib import Path

import numpy as np
import pytest
from django.conf import settings

from engine.kernels import activation
from engine.models.embeddings import EmbeddingLoadError, EmbeddingModel, default_embedding_folder
from tests.fixtures.bert_reference import ReferenceBert

SENTENCES = [
    "A man is playing a guitar.",
    "Someone is playing an instrument.",
    "The stock market fell sharply today.",
    "Ünïcode, emoji 🎸 and punctuation!? all tokenize.",
    " ".join(["long"] * 200),
]


@pytest.fixture(scope="module")
def folder() -> Path:
    return default_embedding_folder(Path(settings.ORCHARD_HOME) / "cache" / "test-models")


@pytest.fixture(scope="module")
def model(folder) -> EmbeddingModel:
    return EmbeddingModel(folder)


def test_the_config_is_read_from_the_sentence_transformers_files(model):
    info = model.info
    assert (info.dimensions, info.context_length, info.vocab_size) == (384, 256, 30522)
    assert info.normalize and info.pooling == "mean"


def test_vectors_match_an_independent_numpy_bert(model, folder):
    reference = ReferenceBert(folder)
    ids = model.tokenize(SENTENCES)
    assert ids[0][0] == 101 and ids[0][-1] == 102  # [CLS] ... [SEP]
    batched = model.embed(ids)  # one padded batch: lengths 9 to 202
    for row, token_ids in enumerate(ids):
        expected = reference.embed(token_ids)
        assert np.abs(batched[row] - expected).max() < 1e-4, SENTENCES[row]
        assert np.abs(model.embed([token_ids])[0] - batched[row]).max() < 1e-5
        assert abs(np.linalg.norm(batched[row]) - 1.0) < 1e-5


def test_mlxs_own_kernels_give_the_same_vectors(model, folder, monkeypatch):
    """ORCHARD_FAST_KERNELS=0 (and any device but the CPU) keeps MLX's erf GELU and attention."""
    assert model.encoder.layers[0]._gelu is activation.gelu  # this machine: the fast kernels
    monkeypatch.setenv("ORCHARD_FAST_KERNELS", "0")
    plain = EmbeddingModel(folder)
    assert plain.encoder.layers[0]._gelu is not activation.gelu
    ids = model.tokenize(SENTENCES)
    assert np.abs(plain.embed(ids) - model.embed(ids)).max() < 1e-5


def test_similar_sentences_score_higher_than_unrelated_ones(model):
    vectors = model.embed(model.tokenize(SENTENCES[:3]))
    similar, unrelated = vectors[0] @ vectors[1], vectors[0] @ vectors[2]
    assert similar > 0.5 > unrelated + 0.3


def test_a_folder_that_is_not_an_encoder_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(EmbeddingLoadError):
        EmbeddingModel(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "roberta"}))
    with pytest.raises(EmbeddingLoadError):  # its positions start at 2: not served as a BERT
        EmbeddingModel(tmp_path)
    with pytest.raises(EmbeddingLoadError):
        EmbeddingModel(tmp_path / "missing")
