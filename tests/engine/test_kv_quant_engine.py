"""A quantized KV cache (ModelSpec.kv_cache_bits, engine/cache/quantized.py) in the engines, on a
dense llama and a hybrid qwen3_next with 32-dimensional heads (a group must divide them): greedy
output does not depend on what else runs (alone, batched with chunked prefill, the simple
engine, speculative decoding), a prefix-cache hit and a hit read back from disk change no token,
and the memory budget counts the smaller keys. (engine/cache/quantized.py's own tests drive the
cache classes by hand: tests/engine/test_quantized_kv.py.)"""

from types import SimpleNamespace

import pytest

from engine.cache.disk import PrefixDiskConfig
from engine.core.batched import BatchedEngine
from engine.core.simple import SimpleEngine
from engine.models.loader import LoadedModel, load_model
from tests.engine.conftest import (
    drive,
    greedy,
    make_request,
    manual_engine,
    run_batched,
    run_simple,
)
from tests.engine.test_prefix_identity import assert_same, request, tokens
from tests.fixtures.tiny_models import build_tiny_model

MAX_TOKENS = 8
WIDE_HEADS = {"head_dim": 32}


def wide_path(model_type: str) -> str:
    return str(build_tiny_model(model_type=model_type, tokenizer="qwen3", overrides=WIDE_HEADS))


@pytest.fixture(scope="module", params=["llama", "qwen3_next"])
def wide_model(request) -> LoadedModel:
    return load_model(wide_path(request.param), name=f"wide-{request.param}")


@pytest.fixture(scope="module")
def tiny_wide_llama() -> LoadedModel:
    return load_model(wide_path("llama"), name="wide-llama")


def quantized(bits: int = 8, group: int = 32, **spec) -> dict:
    return {"kv_cache_bits": bits, "kv_cache_group_size": group, **spec}


def prompts(vocab: int, count: int) -> list[list[int]]:
    return [tokens(vocab, 3 + 6 * i, seed=60 + i) for i in range(count)]


@pytest.mark.slow
@pytest.mark.parametrize("bits", [8, 4])
def test_greedy_is_identical_alone_batched_chunked_and_simple(wide_model, bits):
    requests = [
        make_request(f"q{i}", p, greedy(MAX_TOKENS, ignore_eos=True))
        for i, p in enumerate(prompts(wide_model.info.vocab_size, 6))
    ]
    spec = quantized(bits)
    alone = {r.request_id: run_batched(wide_model, [r], **spec) for r in requests}
    batched = run_batched(
        wide_model, requests, join_at=[0, 0, 1, 3, 4, 7], max_num_batched_tokens=12, **spec
    )
    simple = run_simple(wide_model, requests, manual_engine(wide_model, SimpleEngine, **spec))
    full = run_batched(wide_model, requests)
    differs = 0
    for request_ in requests:
        rid = request_.request_id
        assert batched.tokens(rid) == alone[rid].tokens(rid), rid
        assert simple.tokens(rid) == alone[rid].tokens(rid), rid
        differs += full.tokens(rid) != alone[rid].tokens(rid)
    assert differs < len(requests)  # quantized, not another model: not every row differs


@pytest.mark.slow
def test_a_prefix_hit_and_a_disk_hit_change_no_token(wide_model, tmp_path):
    model_type = "qwen3_next" if "next" in wide_model.info.name else "llama"
    vocab = wide_model.info.vocab_size
    system = tokens(vocab, 40, seed=71)
    first = request("first", [*system, *tokens(vocab, 6, seed=72)], checkpoints=[40])
    second = request("second", [*system, *tokens(vocab, 9, seed=73)], checkpoints=[40])
    spec = quantized(4)
    cold = run_batched(wide_model, [second], prefix_cache_bytes=0, **spec)
    disk = PrefixDiskConfig(tmp_path / "prefix", 10**9, block_tokens=16)
    path = wide_path(model_type)
    engine = manual_engine(wide_model, BatchedEngine, path=path, prefix_disk=disk, **spec)
    drive(engine, [first])
    warm = drive(engine, [second])
    assert warm.cached("second") == 40
    assert_same(warm, "second", cold, "second")
    # Evicted to disk (six arrays per attention layer), read back by a new engine.
    engine.prefix_cache.evict(engine.prefix_cache.nbytes)
    assert engine.prefix_cache.disk.flush(30)
    engine.prefix_cache.close()
    again = manual_engine(wide_model, BatchedEngine, path=path, prefix_disk=disk, **spec)
    read = drive(again, [second])
    assert read.cached("second") >= 40
    assert again.prefix_cache.stats().disk_hits == 1
    assert_same(read, "second", cold, "second")
    # Another quantization never reads these files: its keys are other arrays.
    other = manual_engine(wide_model, BatchedEngine, path=path, prefix_disk=disk, **quantized(8))
    assert drive(other, [second]).cached("second") == 0


@pytest.mark.slow
def test_speculative_decoding_on_a_quantized_cache_changes_no_token(tiny_wide_llama):
    vocab = tiny_wide_llama.info.vocab_size
    # Repetitive prompts, so prompt lookup drafts and some drafts are rejected.
    loop = tokens(vocab, 6, seed=81)
    requests = [
        make_request(f"s{i}", [*loop * 4, *tokens(vocab, i + 1, seed=90 + i)], greedy(12))
        for i in range(3)
    ]
    plain = run_batched(tiny_wide_llama, requests, speculative_tokens=0, **quantized(8))
    engine = manual_engine(tiny_wide_llama, BatchedEngine, speculative_tokens=4, **quantized(8))
    drafted = drive(engine, requests)
    assert engine.speculator.num_drafted > 0
    for request_ in requests:
        assert drafted.tokens(request_.request_id) == plain.tokens(request_.request_id)


def test_the_budget_counts_the_quantized_bytes(tiny_wide_llama):
    full = manual_engine(tiny_wide_llama, BatchedEngine)
    eight = manual_engine(tiny_wide_llama, BatchedEngine, **quantized(8))
    four = manual_engine(tiny_wide_llama, BatchedEngine, **quantized(4))
    per_token = [e.layout.kv_bytes_per_token for e in (full, eight, four)]
    # float32 keys: 32 dims x 4 bytes; 8 bits: 32 bytes + a scale and a bias per 32 (8 bytes).
    assert per_token[0] / per_token[1] == pytest.approx(128 / 40)
    assert per_token[0] / per_token[2] == pytest.approx(128 / 24)
    assert four.memory.bytes_per_token == per_token[2]


def test_a_group_that_does_not_divide_the_heads_fails_the_load(tiny_llama):
    with pytest.raises(ValueError, match="size 32 does not divide the model's head dimension 16"):
        manual_engine(tiny_llama, BatchedEngine, **quantized(8, 32))
    with pytest.raises(ValueError, match="bits must be 4 or 8, not 3"):
        manual_engine(tiny_llama, BatchedEngine, **quantized(3, 32))


def test_a_prompt_chunk_reads_the_quantized_keys_dequantized_with_the_same_result(monkeypatch):
    """On the CPU a chunk of more than QUANTIZED_QUERIES positions attends over the quantized
    keys dequantized (MLX's quantized product is 4x slower there): the same result as mlx-lm's
    quantized attention, which decode steps keep."""
    import mlx.core as mx
    from mlx_lm.models.base import quantized_scaled_dot_product_attention

    from engine.kernels.attention import QUANTIZED_QUERIES, scaled_dot_product_attention

    dequantized = []
    dequantize = mx.dequantize
    monkeypatch.setattr(
        mx, "dequantize", lambda *a, **k: dequantized.append(1) or dequantize(*a, **k)
    )
    cache = SimpleNamespace(bits=8, group_size=32)
    length = QUANTIZED_QUERIES + 8
    queries = mx.random.normal((2, 4, length, 32), key=mx.random.key(1))
    keys, values = (mx.random.normal((2, 2, length, 32), key=mx.random.key(i)) for i in (2, 3))
    keys, values = (mx.quantize(x, group_size=32, bits=8) for x in (keys, values))
    ours = scaled_dot_product_attention(queries, keys, values, cache, 0.17, "causal")
    theirs = quantized_scaled_dot_product_attention(
        queries, keys, values, scale=0.17, mask="causal", group_size=32, bits=8
    )
    assert mx.allclose(ours, theirs, atol=1e-4).item()
    assert len(dequantized) == 2  # the keys and the values, once
