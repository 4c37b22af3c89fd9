"""Compute turns (engine/core/turns.py): the engines of one worker compute one step at a time,
first come first served, so two engines with work alternate; an embedding engine whose worker
has another engine computing keeps its forwards small, since each is what that engine's step
may wait for, and a forward pauses between its layers for a waiting engine's step."""

import threading
import time

import numpy as np

import engine.core.turns
from engine.core.embedding import MAX_BATCH_TOKENS, SHARED_BATCH_TOKENS, EmbeddingEngine
from engine.core.turns import ComputeTurns
from engine.models.embeddings import EmbeddingModel
from engine.protocol import ModelSpec
from engine.worker import EngineWorker


def test_engines_with_work_alternate_step_by_step():
    turns, order = ComputeTurns(), []
    chat, embed = object(), object()
    holding = threading.Event()

    def steps(owner, name, count):
        for _ in range(count):
            with turns.turn(owner):
                order.append(name)
                holding.set()
                time.sleep(0.02)  # a step's compute

    with turns.turn(chat):  # the chat engine is mid-step when the embedding engine comes
        other = threading.Thread(target=steps, args=(embed, "embed", 3))
        other.start()
        while not turns.contended():
            time.sleep(0.001)
        order.append("chat")
    steps(chat, "chat", 3)
    other.join()
    # Its next turn queued behind the waiting engine: one step each, in turn.
    assert order[:6] == ["chat", "embed", "chat", "embed", "chat", "embed"]
    assert not turns.contended()


def test_an_engine_alone_never_waits_and_others_see_it_working(monkeypatch):
    monkeypatch.setattr(engine.core.turns, "ACTIVE_WINDOW_S", 0.2)
    turns = ComputeTurns()
    chat, embed = object(), object()
    for _ in range(100):
        with turns.turn(chat):
            pass
    assert turns.others_active(embed) and not turns.others_active(chat)
    time.sleep(0.3)
    assert not turns.others_active(embed)


def test_a_workers_engines_share_its_turns(tiny_llama, minilm_path):
    worker = EngineWorker(
        loader=lambda spec: tiny_llama, embedding_loader=lambda spec: EmbeddingModel(minilm_path)
    )
    try:
        worker.serve(ModelSpec("tiny", "unused")).result(timeout=60)
        worker.serve(ModelSpec("minilm", "unused", kind="embedding")).result(timeout=60)
        assert worker.get("tiny").compute_turns is worker.compute_turns
        assert worker.embedder("minilm").compute_turns is worker.compute_turns
    finally:
        worker.shutdown(10)


def test_embedding_forwards_stay_small_while_another_engine_computes(minilm_path, monkeypatch):
    monkeypatch.setattr(engine.core.turns, "ACTIVE_WINDOW_S", 60.0)  # however slow the machine
    model = EmbeddingModel(minilm_path)
    embedder = EmbeddingEngine(ModelSpec("minilm", "unused", kind="embedding"), lambda: model)
    chat = object()
    assert embedder.start().result(timeout=60) == model.info
    try:
        rows = model.tokenize(["the orchard's apples and pears, " * 9] * 12)
        width = max(len(ids) for ids in rows)
        assert 4 * width <= MAX_BATCH_TOKENS and 2 * width > SHARED_BATCH_TOKENS
        embedder.submit(rows).future.result(timeout=60)
        alone = embedder.num_forwards
        with embedder.compute_turns.turn(chat):  # another engine of the worker just stepped
            pass
        embedder.submit(rows).future.result(timeout=60)
        shared = embedder.num_forwards - alone
        assert alone <= len(rows) * width // MAX_BATCH_TOKENS + 1
        assert shared == len(rows)  # one row a forward: two would pass the shared budget
    finally:
        embedder.stop(10)


def test_a_step_that_pauses_lets_a_waiting_engine_in_between_its_parts(monkeypatch):
    monkeypatch.setattr(engine.core.turns, "PAUSE_AFTER_S", 0.05)
    turns, order = ComputeTurns(), []
    embed, chat = object(), object()

    def chat_step():
        with turns.turn(chat):
            order.append("chat")

    with turns.turn(embed):
        turns.pause(embed)  # nobody waits: goes on
        order.append("layer 1")
        waiter = threading.Thread(target=chat_step)
        waiter.start()
        while not turns.contended():
            time.sleep(0.001)
        turns.pause(embed)  # the turn is younger than PAUSE_AFTER_S: goes on
        order.append("layer 2")
        time.sleep(0.06)
        turns.pause(embed)  # held long enough: the chat's step comes first
        order.append("layer 3")
        waiter.join(5)
    assert order == ["layer 1", "layer 2", "chat", "layer 3"]
    assert turns.num_pauses == 1 and not turns.contended()
    with turns.turn(chat):  # the turn was handed back whole: nobody holds the device
        pass


def test_a_long_embedding_forward_pauses_between_layers_for_a_chat_step(minilm_path, monkeypatch):
    monkeypatch.setattr(engine.core.turns, "PAUSE_AFTER_S", 0.0)  # at every layer, however fast
    model = EmbeddingModel(minilm_path)
    embedder = EmbeddingEngine(ModelSpec("minilm", "unused", kind="embedding"), lambda: model)
    turns, chat = embedder.compute_turns, object()
    assert embedder.start().result(timeout=60) == model.info
    try:
        row = model.tokenize(["the orchard's apples and pears, " * 40])[0][:256]
        expected = embedder.submit([row]).future.result(timeout=60)[0]
        forwards = embedder.num_forwards
        job = embedder.submit([row] * 8)  # eight forwards of one row (MAX_BATCH_TOKENS)
        chat_steps = 0
        while not job.future.done():  # a busy chat engine: a step whenever it gets the turn
            with turns.turn(chat):
                chat_steps += 1
        assert embedder.num_forwards - forwards == 8
        # Without pauses the two would alternate, a chat step a forward; with them the chat
        # steps between the layers (6 a forward) of most forwards.
        assert turns.num_pauses >= 8 and chat_steps > 2 * 8
        assert np.abs(job.future.result() - expected).max() < 1e-5  # the same vectors
    finally:
        embedder.stop(10)
