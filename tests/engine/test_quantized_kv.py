"""Quantized KV caches (engine/cache/quantized.py) in continuous batching: rows prefilled alone,
merged, joined and dropped, rolled and trimmed as the runner does, decode to the same greedy
tokens as each prompt alone; the batch cache keeps BatchKVCache's bookkeeping and costs the
bytes its bits say."""

from __future__ import annotations

import random

import engine  # noqa: F401  (OpenBLAS before mlx)

# isort: split
import mlx.core as mx
import pytest
from mlx_lm.models.cache import ArraysCache, BatchKVCache, KVCache, make_prompt_cache

from engine.cache.mlx_caches import concatenate, merge
from engine.cache.quantized import (
    BatchQuantizedKVCache,
    QuantizedCache,
    check_group,
    quantize_layers,
)
from engine.models.loader import load_model
from tests.fixtures.tiny_models import build_tiny_model

GROUP = 32  # the tiny models' head dimension: the one group size that divides it
BITS = [8, 4]
# One step of [-1, 1] at 8 and 4 bits, and some: MLX's affine quantization errs by up to a
# step here (measured), not half of one.
ATOL = {8: 0.01, 4: 0.15}


@pytest.fixture(scope="module", params=["llama", "qwen3_next"])
def model(request):
    """A dense model and a hybrid one (ArraysCache layers, left as they are), head_dim 32."""
    path = build_tiny_model(model_type=request.param, tokenizer="qwen3", overrides={"head_dim": 32})
    return load_model(path, name=f"tiny-{request.param}-32").model


@pytest.fixture(scope="module")
def llama():
    path = build_tiny_model(model_type="llama", tokenizer="qwen3", overrides={"head_dim": 32})
    return load_model(path, name="tiny-llama-32").model


def _prompts(model, lengths: list[int], seed: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    vocab = model.model.embed_tokens.weight.shape[0]
    return [[rng.randrange(1000, vocab - 1000) for _ in range(n)] for n in lengths]


def _prefilled(model, prompt: list[int], bits: int) -> list:
    """A prompt's own cache holding all but its last token (fed with the decode step)."""
    cache = quantize_layers(make_prompt_cache(model), bits, GROUP)
    model(mx.array([prompt[:-1]]), cache=cache)
    return cache


def _step(model, cache: list, last: list[int]) -> list[int]:
    logits = model(mx.array([[t] for t in last]), cache=cache)
    return mx.argmax(logits[:, -1, :], axis=-1).tolist()


def _alone(model, prompt: list[int], steps: int, bits: int) -> list[int]:
    cache, out = _prefilled(model, prompt, bits), [prompt[-1]]
    for _ in range(steps):
        out += _step(model, cache, out[-1:])
    return out[1:]


def _decode(model, cache: list, outs: list[list[int]], steps: int) -> None:
    """`steps` greedy steps of every row; `outs[i]`: row i's fed and sampled tokens so far."""
    for _ in range(steps):
        for out, token in zip(outs, _step(model, cache, [out[-1] for out in outs]), strict=True):
            out.append(token)


@pytest.mark.parametrize("bits", BITS)
def test_merged_rows_decode_as_alone(model, bits):
    prompts = _prompts(model, [5, 11, 17])
    cache = merge([_prefilled(model, p, bits) for p in prompts])
    attention = [layer for layer in cache if not isinstance(layer, ArraysCache)]
    assert attention and all(type(layer) is BatchQuantizedKVCache for layer in attention)
    assert attention[0].left_padding.tolist() == [12, 6, 0]
    outs = [[p[-1]] for p in prompts]
    _decode(model, cache, outs, 8)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out[1:] == _alone(model, prompt, 8, bits)


@pytest.mark.parametrize("bits", BITS)
def test_rows_joining_and_leaving_keep_the_others(model, bits):
    """A row joins a running batch (extend, as the runner's `_extend`), later another leaves
    (filter); then a row is taken out (extract) and decodes on alone."""
    a, b, c = _prompts(model, [9, 4, 14], seed=5)
    cache = merge([_prefilled(model, p, bits) for p in (a, b)])
    outs = [[a[-1]], [b[-1]]]
    _decode(model, cache, outs, 3)
    concatenate(cache, merge([_prefilled(model, c, bits)]))
    outs.append([c[-1]])
    _decode(model, cache, outs, 4)
    for layer in cache:
        layer.filter([0, 2])
    del outs[1]
    _decode(model, cache, outs, 3)
    assert outs[0][1:] == _alone(model, a, 10, bits)
    assert outs[1][1:] == _alone(model, c, 7, bits)
    single = [layer.extract(1) for layer in cache]
    quantized = [layer for layer in single if not isinstance(layer, ArraysCache)]
    assert all(type(layer) is QuantizedCache for layer in quantized)
    assert quantized[0].size() == len(c) - 1 + 7
    rest = [outs[1][-1]]
    _decode(model, single, [rest], 2)
    assert outs[1][1:] + rest[1:] == _alone(model, c, 9, bits)


@pytest.mark.parametrize("bits", BITS)
def test_rejected_drafts_leave_the_cache(llama, bits):
    """accept_drafts' cache handling (engine/core/forward.py): a 3-wide block per row (last
    token and two drafts), the rejected positions trimmed where common and rolled into the
    left padding where not; the rows then decode as alone."""
    prompts = _prompts(llama, [6, 13], seed=11)
    refs = [_alone(llama, p, 9, bits) for p in prompts]
    cache = merge([_prefilled(llama, p, bits) for p in prompts])
    outs = [[p[-1]] for p in prompts]
    _decode(llama, cache, outs, 3)
    # Row 0 drafts its right next token then a wrong one; row 1 a wrong one first.
    blocks = [
        [outs[0][-1], refs[0][3], _other(refs[0][4])],
        [outs[1][-1], _other(refs[1][3]), refs[1][4]],
    ]
    logits = llama(mx.array(blocks), cache=cache)
    sampled = mx.argmax(logits, axis=-1).tolist()
    outs[0] += sampled[0][:2]  # one draft token accepted, one more sampled: 1 rejected
    outs[1] += sampled[1][:1]  # none accepted: 2 rejected
    for layer in cache:
        layer.trim(1)
        layer.prepare(right_padding=[0, 1])
        layer.finalize()
    assert cache[0].offset.tolist() == [len(prompts[0]) + 4, len(prompts[1]) + 3]
    _decode(llama, cache, outs, 4)
    assert outs[0][1:] == refs[0][:9]
    assert outs[1][1:] == refs[1][:8]


def _other(token: int) -> int:
    return 1000 if token != 1000 else 1001


def _pair(lengths: list[int], bits: int, group: int, dim: int = 32, seed: int = 0):
    """A quantized batch cache and a BatchKVCache merged from single caches fed the same
    keys and values (uniform in [-1, 1]); a length 0 leaves its cache empty."""
    mx.random.seed(seed)
    quantized, plain = [], []
    for n in lengths:
        q, p = QuantizedCache(group, bits), KVCache()
        if n:
            k, v = (mx.random.uniform(-1, 1, (1, 2, n, dim)) for _ in range(2))
            q.update_and_fetch(k, v)
            p.update_and_fetch(k, v)
        quantized.append(q)
        plain.append(p)
    return QuantizedCache.merge(quantized), BatchKVCache.merge(plain)


def _assert_alike(q: BatchQuantizedKVCache, p: BatchKVCache, bits: int) -> None:
    assert q.left_padding.tolist() == p.left_padding.tolist()
    assert q.offset.tolist() == p.offset.tolist()
    assert q.size() == p.size()
    for ours, theirs in zip(q.keys_and_values(), p.keys_and_values(), strict=True):
        deq = mx.dequantize(*ours, group_size=q.group_size, bits=q.bits)
        assert deq.shape == theirs.shape
        assert mx.allclose(deq, theirs, atol=ATOL[bits], rtol=0).item()


@pytest.mark.parametrize("bits", BITS)
def test_row_operations_match_batch_kv_cache(bits):
    q, p = _pair([3, 7, 0], bits, GROUP)
    _assert_alike(q, p, bits)
    # A padded prefill step (the runner's _prefill_together), rolled into the left padding.
    k, v = (mx.random.uniform(-1, 1, (3, 2, 4, 32)) for _ in range(2))
    for cache in (q, p):
        cache.prepare(lengths=[4, 2, 1], right_padding=[0, 2, 3])
        cache.update_and_fetch(k, v)
        cache.finalize()
    _assert_alike(q, p, bits)
    for cache in (q, p):
        cache.trim(1)
    _assert_alike(q, p, bits)
    for cache in (q, p):
        cache.filter([2, 0])
    _assert_alike(q, p, bits)
    q2, p2 = _pair([12, 2], bits, GROUP, seed=1)
    q.extend(q2)
    p.extend(p2)
    _assert_alike(q, p, bits)
    row_q, row_p = q.extract(2), p.extract(2)
    assert row_q.offset == row_p.offset == 12
    deq = mx.dequantize(*row_q.keys, group_size=GROUP, bits=bits)
    assert mx.allclose(deq, row_p.keys, atol=ATOL[bits], rtol=0).item()


def test_empty_caches_merge_and_extend():
    q, p = _pair([0, 0], 8, GROUP)
    assert q.empty() and q.nbytes == 0 and q.size() == 0
    q.extend(_pair([0], 8, GROUP)[0])
    p.extend(_pair([0], 8, GROUP)[1])
    assert q.empty() and q.left_padding.tolist() == p.left_padding.tolist()
    filled_q, filled_p = _pair([5, 2], 8, GROUP)
    q.extend(filled_q)
    p.extend(filled_p)
    _assert_alike(q, p, 8)
    assert QuantizedCache(GROUP, 8).nbytes == 0 and QuantizedCache(GROUP, 8).size() == 0


@pytest.mark.parametrize(("bits", "group"), [(8, 32), (8, 64), (4, 32), (4, 128)])
def test_bytes_follow_the_bits(bits, group):
    """Per float32 element: `bits` / 8 bytes, plus a float32 scale and bias per group."""
    q, p = _pair([9, 20, 14], bits, group, dim=128)
    for cache in (q, p):
        cache.update_and_fetch(*(mx.random.uniform(-1, 1, (3, 2, 1, 128)) for _ in range(2)))
    ratio = (bits / 8 + 8 / group) / 4
    assert q.nbytes == ratio * p.nbytes
    assert q.nbytes < p.nbytes * {8: 0.32, 4: 0.19}[bits]


def test_group_size_must_divide_head_dims():
    check_group({64, 128}, 64)
    with pytest.raises(ValueError, match="group size 64 does not divide the model's head dim"):
        check_group({32}, 64)
    with pytest.raises(ValueError, match="must be one of 32, 64, 128, not 48"):
        check_group({96}, 48)
    with pytest.raises(ValueError, match="bits must be 4 or 8, not 3"):
        quantize_layers([KVCache()], 3, 64)


def test_quantize_layers_keeps_other_kinds(model):
    cache = quantize_layers(make_prompt_cache(model), 4, GROUP)
    plain = make_prompt_cache(model)
    assert len(cache) == len(plain)
    for ours, theirs in zip(cache, plain, strict=True):
        if type(theirs) is KVCache:
            assert type(ours) is QuantizedCache and (ours.bits, ours.group_size) == (4, GROUP)
        else:
            assert type(ours) is type(theirs)
