"""Length cohorts (engine/cache/cohorts.py): a decode batch's attention caches in groups of rows of
about the same length, so a row's keys and values cost its own length.

By hand on a dense llama, a hybrid qwen3_next and an 8-bit cache: the cohorts form, hold fewer
bytes than one padded batch, and every forward, row operation (rows leaving, rolls of rejected
drafts) and prefix-cache copy gives what the padded batch gives. In the engine: greedy output
and logprobs identical with cohorts on and off (dense and hybrid, batched with chunked prefill,
quantized, speculative). The scheduler's budget counts rows by cohort; a model whose attention
cannot read cohorts, and the switches, keep one padded batch.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.utils import load_model as mlx_lm_load_model

import engine.cache.memory as memory
from engine.cache import mlx_caches as caches
from engine.cache.budget import CACHE_STEP_TOKENS, MemoryBudget, length_groups
from engine.cache.cohorts import PAD_LIMIT, CohortKVCache, wrap
from engine.core.scheduler import Scheduler
from engine.models.loader import LoadedModel, load_model
from tests.engine.conftest import manual_engine, run_batched
from tests.engine.test_prefix_identity import assert_same, request, tokens
from tests.engine.test_scheduler import request as sched_request
from tests.fixtures.tiny_models import build_tiny_model

WIDE_HEADS = {"head_dim": 32}  # an 8-bit cache's groups of 32 must divide the head dimension


def wide(model_type: str) -> LoadedModel:
    path = build_tiny_model(model_type=model_type, tokenizer="qwen3", overrides=WIDE_HEADS)
    return load_model(path, name=f"wide-{model_type}")


@pytest.fixture(scope="module")
def wide_llama() -> LoadedModel:
    return wide("llama")


@pytest.fixture(scope="module", params=["llama", "qwen3_next"])
def wide_model(request) -> LoadedModel:
    return (
        request.getfixturevalue("wide_llama") if request.param == "llama" else wide(request.param)
    )


def hybrid(loaded: LoadedModel) -> bool:
    return "next" in loaded.info.name


def test_length_groups_keep_rows_within_the_limit_in_the_fewest_groups():
    assert length_groups([300, 10, 12, 290, 40], 16) == [[0, 3], [4], [2, 1]]
    assert length_groups([5, 5, 5], 0) == [[0, 1, 2]]
    assert length_groups([1, 2, 3], 0) == [[2], [1], [0]]
    assert length_groups([], 8) == []


def test_the_budget_counts_each_cohort_at_its_own_longest_row():
    long, short = 2000 + 56, 200 + 56
    one_batch = MemoryBudget(max_bytes=10**9, bytes_per_token=10, bytes_per_sequence=3)
    cohorts = dataclasses.replace(one_batch, pad_tokens=CACHE_STEP_TOKENS)
    assert one_batch.need([long, short, short]) == 3 * (2304 * 10 + 3)
    assert cohorts.need([long, short, short]) == (2304 + 2 * 256) * 10 + 3 * 3
    assert cohorts.need([short] * 4) == one_batch.need([short] * 4)  # uniform: no change
    assert cohorts.need([]) == 0


def test_admission_beside_a_long_row_counts_the_short_rows_at_their_own_length():
    def admitted(pad_tokens):
        budget = MemoryBudget(
            max_bytes=(2304 + 2 * 256) * 10, bytes_per_token=10, pad_tokens=pad_tokens
        )
        scheduler = Scheduler(max_num_seqs=16, max_num_batched_tokens=4096, memory=budget)
        scheduler.add(sched_request("long", 2000, max_tokens=56))
        for i in range(4):
            scheduler.add(sched_request(f"s{i}", 200, max_tokens=56))
        for _ in range(3):
            scheduler.schedule()
        return [r.request_id for r in scheduler.running]

    assert admitted(None) == ["long"]  # every row at 2,304 tokens: the others wait
    assert admitted(CACHE_STEP_TOKENS) == ["long", "s0", "s1"]


def prompt_caches(loaded: LoadedModel, lengths: list[int], quant=None) -> list:
    out = []
    for i, length in enumerate(lengths):
        cache = caches.make_cache(loaded.model, quant)
        loaded.model(mx.array([tokens(loaded.info.vocab_size, length, seed=300 + i)]), cache=cache)
        out.append(cache)
    return out


def kv_layers(cache: list) -> list[CohortKVCache]:
    return [layer for layer in cache if isinstance(layer, CohortKVCache)]


def assert_same_forward(loaded, grouped, padded, steps: int = 2) -> None:
    """Greedy decode steps through both caches give the same logits."""
    rows = len(kv_layers(grouped)[0].where)
    feed = mx.array([[7 + r] for r in range(rows)])
    for _ in range(steps):
        ours = loaded.model(feed, cache=grouped)
        theirs = loaded.model(feed, cache=padded)
        assert mx.allclose(ours, theirs, rtol=1e-4, atol=1e-4).item()
        feed = mx.argmax(theirs[:, -1:, :], axis=-1)


@pytest.mark.parametrize("bits", [None, 8])
def test_cohorts_hold_fewer_bytes_and_compute_what_one_padded_batch_does(wide_model, bits):
    quant = caches.KVQuant(bits, 32) if bits else None
    lengths = [60, 54, 47, 3, 5]
    singles = prompt_caches(wide_model, lengths, quant)
    padded = caches.merge(singles)
    grouped = wrap(caches.merge(singles[:2]), pad_limit=8)
    caches.concatenate(grouped, caches.merge(singles[2:]))
    layer = kv_layers(grouped)[0]
    assert layer.num_cohorts == 3  # {60, 54}, {47} (13 short of 60), {3, 5}
    assert sorted(len(p) for p in layer.pads) == [1, 2, 2]
    assert max(max(p) for p in layer.pads) <= 8
    padded_kv = sum(lay.nbytes for lay in padded if hasattr(lay, "left_padding"))
    grouped_kv = sum(lay.nbytes for lay in kv_layers(grouped))
    assert grouped_kv < 0.65 * padded_kv  # 2 x 60 + 47 + 2 x 5 tokens against 5 x 60
    assert_same_forward(wide_model, grouped, padded)

    # Every row's keys and values as the prefix cache copies them out.
    for row, length in enumerate(lengths):
        ours = caches.kv_source(grouped, row)(0, length + 2)
        theirs = caches.kv_source(padded, row)(0, length + 2)
        for mine, other in zip(ours, theirs, strict=True):
            if other is not None:
                assert all(mx.array_equal(a, b).item() for a, b in zip(mine, other, strict=True))

    # The 60 leaves: its cohort keeps the 54, which now fits with the 47 and merges with it.
    for cache in (grouped, padded):
        for lay in cache:
            lay.filter([1, 2, 3, 4])
    assert layer.num_cohorts == 2
    cohort_of = [c for c, _ in layer.where]
    assert cohort_of[0] == cohort_of[1] != cohort_of[2] == cohort_of[3]
    assert_same_forward(wide_model, grouped, padded)


def test_rejected_drafts_rolled_into_the_padding_split_a_cohort_past_its_limit(wide_llama):
    wide_model = wide_llama  # drafts are rolled only where every layer is attention
    singles = prompt_caches(wide_model, [20, 21, 22])
    padded = caches.merge(singles)
    grouped = wrap(caches.merge(singles), pad_limit=3)
    layer = kv_layers(grouped)[0]
    assert layer.num_cohorts == 1
    feed = mx.array([[5, 6, 7]] * 3)  # a 2-token draft after each row's last token
    for cache in (grouped, padded):
        wide_model.model(feed, cache=cache)
        for lay in cache:
            lay.trim(1)
            lay.prepare(right_padding=[2, 0, 0])
            lay.finalize()
    assert layer.num_cohorts == 2  # the first row's padding went from 2 to 4, past 3
    assert max(max(p) for p in layer.pads) <= 3
    assert_same_forward(wide_model, grouped, padded)


def test_greedy_output_is_identical_with_cohorts_on_and_off(wide_model, monkeypatch):
    vocab = wide_model.info.vocab_size
    requests = [request(f"c{i}", tokens(vocab, 3 + 9 * i, seed=80 + i)) for i in range(6)]
    join_at = [0, 0, 1, 3, 4, 7]
    configs = [{}, {"kv_cache_bits": 8, "kv_cache_group_size": 32}]
    if not hybrid(wide_model):
        configs.append({"speculative_tokens": 3})
    seen = []
    changed = CohortKVCache._changed

    def spy(self):
        seen.append(self.num_cohorts)
        changed(self)

    monkeypatch.setattr(CohortKVCache, "_changed", spy)
    monkeypatch.setattr(memory, "PAD_LIMIT", 4)  # rows apart by over 4 tokens: apart
    for spec in configs:
        kwargs = {"max_num_batched_tokens": 12, **spec}
        off = run_batched(wide_model, requests, join_at, compact_kv=False, **kwargs)
        seen.clear()
        on = run_batched(wide_model, requests, join_at, **kwargs)
        assert max(seen) >= 3, spec
        for r in requests:
            assert_same(on, r.request_id, off, r.request_id)


def test_a_model_whose_attention_cannot_read_cohorts_keeps_one_padded_batch(tmp_path):
    path = build_tiny_model(model_type="llama", tokenizer="qwen3")
    loaded = load_model(path, name="tiny-llama")
    raw, _ = mlx_lm_load_model(Path(path))  # mlx-lm's attention, not Orchard's
    with pytest.raises(ValueError, match="cohorts"):
        caches.check_cohorts(raw)
    caches.check_cohorts(loaded.model)
    assert manual_engine(loaded).cohort_pad == PAD_LIMIT
    bare = dataclasses.replace(loaded, model=raw)
    engine = manual_engine(bare)
    assert engine.cohort_pad is None and engine.memory.pad_tokens is None
    vocab = loaded.info.vocab_size
    requests = [request(f"b{i}", tokens(vocab, 4 + 300 * i, seed=90 + i)) for i in range(2)]
    ours = run_batched(bare, requests)
    theirs = run_batched(loaded, requests)
    for r in requests:
        assert ours.tokens(r.request_id) == theirs.tokens(r.request_id)


def test_the_switches_turn_cohorts_off(monkeypatch):
    loaded = load_model(build_tiny_model(model_type="llama", tokenizer="qwen3"), name="t")
    assert manual_engine(loaded, compact_kv=False).cohort_pad is None
    monkeypatch.setenv(memory.COMPACT_SWITCH, "0")
    assert manual_engine(loaded).cohort_pad is None
    monkeypatch.setenv(memory.COMPACT_SWITCH, "1")
    assert manual_engine(loaded).memory.pad_tokens == PAD_LIMIT
