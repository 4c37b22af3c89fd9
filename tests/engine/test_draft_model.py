"""Speculative decoding with a draft model (engine/core/draft_model.py): outputs identical with and
without it (greedy, seeded sampling at temperature > 0, n > 1, rows joining and leaving), a
draft model that agrees with the served one has all its drafts kept, and a draft model that
cannot draft for a model is refused when the model loads."""

from dataclasses import replace

import pytest

from engine.core import batched
from engine.core.batched import BatchedEngine
from engine.core.draft_model import DraftModelError
from engine.models.loader import load_model
from engine.protocol import SamplingParams
from tests.engine.conftest import drive, greedy, make_request, manual_engine
from tests.engine.test_identity import assert_same_events
from tests.fixtures.tiny_models import build_tiny_model


def llama_path():
    return str(build_tiny_model(model_type="llama", tokenizer="qwen3"))


@pytest.fixture(scope="module", autouse=True)
def draft_models_load_once(tiny_qwen3_next):
    """The engine loads its draft model from the spec's path as always; a path this file
    loaded before is served from here (a load is ~2 s, most of it the tokenizer). The hybrid
    model's path is the suite's already loaded one."""
    hybrid = str(build_tiny_model(model_type="qwen3_next", tokenizer="qwen3"))
    loaded = {hybrid: tiny_qwen3_next}

    def load_once(path):
        if str(path) not in loaded:
            loaded[str(path)] = load_model(path)
        return loaded[str(path)]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(batched, "load_model", load_once)
        yield


def engine_with(loaded, draft_path: str | None, **kwargs) -> BatchedEngine:
    engine = manual_engine(
        loaded, BatchedEngine, speculative_tokens=4, draft_path=draft_path, **kwargs
    )
    if engine.speculator is not None:
        engine.speculator.adaptive = False  # drafts whatever the step times say
    return engine


def requests_for(vocab: int) -> list:
    seeded = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=20, ignore_eos=True)
    params = [
        greedy(20, ignore_eos=True, logprobs=True, top_logprobs=2),
        replace(seeded, seed=5, n=2),
        greedy(9, ignore_eos=True),
        replace(seeded, seed=8, temperature=1.4, logprobs=True),
    ]
    prompts = [
        [1000 + (37 * i + 11 * j) % (vocab - 2000) for j in range(12 + 5 * i)] for i in range(4)
    ]
    return [
        make_request(f"r{i}", p, q) for i, (p, q) in enumerate(zip(prompts, params, strict=True))
    ]


@pytest.mark.slow
def test_outputs_are_identical_with_a_draft_model_and_without_speculation(tiny_llama):
    """A draft model of the same tokenizer but other weights (a tiny qwen3 for a tiny llama):
    most drafts are rejected, some kept, and every event is what it is without drafts."""
    requests = requests_for(tiny_llama.info.vocab_size)
    join_at = [0, 0, 2, 3]
    off = drive(manual_engine(tiny_llama, BatchedEngine, speculative_tokens=0), requests, join_at)
    qwen3 = str(build_tiny_model(model_type="qwen3", tokenizer="qwen3"))
    engine = engine_with(tiny_llama, qwen3)
    assert engine.draft_model is not None and engine.speculator.draft_model
    on = drive(engine, requests, join_at)
    for request in requests:
        for index in range(request.sampling.n):
            key = (request.request_id, index)
            assert_same_events(on.events[key], off.events[key])
    assert engine.speculator.num_drafted > 0
    assert engine.speculator.num_accepted < engine.speculator.num_drafted
    assert not engine.draft_model._rows, "finished rows' draft caches are dropped"


@pytest.mark.slow
def test_a_draft_model_that_agrees_has_every_draft_kept_and_saves_steps(tiny_llama):
    """The served model as its own draft: greedy drafts are exactly its next tokens, so
    every draft is kept and a sequence needs about a fifth of the steps."""
    prompt = [1000 + 7 * j for j in range(30)]
    request = make_request("a", prompt, greedy(40, ignore_eos=True))
    plain = manual_engine(tiny_llama, BatchedEngine, speculative_tokens=0)
    off = drive(plain, [request])
    engine = engine_with(tiny_llama, llama_path())
    steps = []
    original = engine.step

    def counting_step():
        steps.append(1)
        original()

    engine.step = counting_step
    on = drive(engine, [request])
    assert on.tokens("a") == off.tokens("a")
    speculator = engine.speculator
    assert speculator.num_drafted > 0 and speculator.num_accepted == speculator.num_drafted
    assert len(steps) <= 12  # 40 tokens: the prompt's step, then up to 5 tokens a step


@pytest.mark.slow
def test_a_draft_model_catches_up_after_rejections_and_across_turns(tiny_llama):
    """Rejected drafts are cut from the draft model's cache; a sequence it has not seen (a
    new request continuing an old conversation) is fed whole first."""
    qwen3 = str(build_tiny_model(model_type="qwen3", tokenizer="qwen3"))
    engine = engine_with(tiny_llama, qwen3)
    draft = engine.draft_model
    fed = []
    original = draft._caught_up

    def spy(seq):
        row = original(seq)
        fed.append((list(row.fed), (*seq.request.prompt_token_ids, *seq.output_token_ids)))
        return row

    draft._caught_up = spy
    prompt = [1000 + 13 * j for j in range(25)]
    drive(engine, [make_request("a", prompt, greedy(16, ignore_eos=True))])
    assert fed
    for row_fed, tokens in fed:
        # The draft cache holds exactly the sequence's tokens but its last, whatever it drafted.
        assert row_fed == list(tokens[:-1])


def test_a_draft_model_of_another_tokenizer_is_refused(tiny_llama):
    llama3 = str(build_tiny_model(model_type="llama", tokenizer="llama3_1"))
    with pytest.raises(DraftModelError, match="does not share the tokenizer"):
        engine_with(tiny_llama, llama3)


def test_a_recurrent_draft_model_or_served_model_is_refused(tiny_llama, tiny_qwen3_next):
    hybrid = str(build_tiny_model(model_type="qwen3_next", tokenizer="qwen3"))
    with pytest.raises(DraftModelError, match="other than attention"):
        engine_with(tiny_llama, hybrid)
    with pytest.raises(DraftModelError, match="cannot take drafts"):
        engine_with(tiny_qwen3_next, llama_path())
    # Without speculation the draft model is not loaded at all.
    engine = manual_engine(tiny_llama, BatchedEngine, speculative_tokens=0, draft_path=hybrid)
    assert engine.draft_model is None and engine.speculator is None
