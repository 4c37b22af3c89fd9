"""The fast kernels' installation into mlx-lm models (engine/kernels/fast.py): by the loader,
in dense and hybrid models, on shared modules; outputs within rounding and greedy tokens
unchanged by it, in mlx-lm's loop and in Orchard's engine."""

import math
import random
import shutil
from dataclasses import replace

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models import base, switch_layers
from mlx_lm.utils import load_model as mlx_load_model

from engine.kernels import attention
from engine.kernels import fast as kernels
from engine.models.loader import load_model
from engine.protocol import SamplingParams
from tests.engine.conftest import make_request, run_batched
from tests.fixtures.tiny_models import build_tiny_model

pytestmark = pytest.mark.skipif(
    mx.default_device() != mx.cpu or shutil.which("g++") is None,
    reason="the fast kernels are for MLX's CPU backend, whose compiler runs g++",
)


def fast_modules(model: nn.Module) -> list[str]:
    return [name for name, m in model.named_modules() if getattr(m, "_orchard_fast", False)]


def test_the_engine_tests_models_have_it_unless_switched_off(tiny_llama, tiny_qwen3_next):
    # The identity tests compare Orchard's paths on these models: all of them run the same kernels.
    enabled = kernels.fast_kernels_enabled()
    for model in (tiny_llama.model, tiny_qwen3_next.model):
        names = fast_modules(model)
        assert any(n.endswith(".mlp") for n in names) == enabled
        assert any(n.endswith(".self_attn") for n in names) == enabled


def test_loader_installs_it_and_outputs_stay_within_rounding(monkeypatch):
    path = build_tiny_model(model_type="llama", tokenizer="qwen3")
    monkeypatch.delenv(kernels.ENV_SWITCH, raising=False)
    assert kernels.fast_kernels_enabled()
    fast = load_model(path)
    assert sorted(fast_modules(fast.model)) == [
        "model.layers.0.mlp",
        "model.layers.0.self_attn",
        "model.layers.0.self_attn.rope",
        "model.layers.1.mlp",
        "model.layers.1.self_attn",
        "model.layers.1.self_attn.rope",
    ]
    monkeypatch.setenv(kernels.ENV_SWITCH, "0")
    assert not kernels.fast_kernels_enabled()
    plain = load_model(path)
    assert fast_modules(plain.model) == []
    # MLX's own attention, behind the dispatch that reads a batch's length cohorts.
    grouped = [n for n, m in plain.model.named_modules() if getattr(m, "_orchard_grouped", False)]
    assert sorted(grouped) == ["model.layers.0.self_attn", "model.layers.1.self_attn"]

    tokens = mx.array([[3000 + 7 * i for i in range(40)]])
    ours, theirs = fast.model(tokens), plain.model(tokens)
    assert np.abs(np.array(ours - theirs)).max() < 1e-4
    assert mx.array_equal(mx.argmax(ours, axis=-1), mx.argmax(theirs, axis=-1))


def test_hybrid_model_gets_it_in_mlps_and_gated_norms(monkeypatch):
    monkeypatch.delenv(kernels.ENV_SWITCH, raising=False)
    model = load_model(build_tiny_model(model_type="qwen3_next", tokenizer="qwen3")).model
    names = fast_modules(model)
    assert "model.layers.0.mlp" in names and "model.layers.1.mlp" in names
    assert "model.layers.0.linear_attn.norm" in names  # precise_swiglu in the gated RMSNorm
    assert "model.layers.1.self_attn" in names  # the full-attention layer


def test_install_copies_shared_modules_and_keeps_parameters():
    class Experts(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = [switch_layers.SwitchGLU(8, 16, 4) for _ in range(2)]

        def __call__(self, x, indices):
            return self.blocks[1](self.blocks[0](x, indices).sum(-2), indices)

    model = Experts()
    shared = model.blocks[0].activation
    assert shared is model.blocks[1].activation  # mlx-lm's default SwiGLU() instance
    weights = model.blocks[0].gate_proj.weight
    x, indices = mx.random.normal((2, 3, 8)), mx.array([[[0, 1]] * 3] * 2)
    before = model(x, indices)

    assert kernels.install(model) == 1
    assert type(shared) is switch_layers.SwiGLU  # other models keep theirs
    assert model.blocks[0].activation is model.blocks[1].activation is not shared
    assert model.blocks[0].gate_proj.weight is weights
    assert np.allclose(np.array(model(x, indices)), np.array(before), rtol=1e-5, atol=1e-6)
    assert kernels.install(model) == 1  # installing twice changes nothing


def greedy_tokens(model: nn.Module, prompt: list[int], count: int) -> list[int]:
    steps = generate_step(
        mx.array(prompt), model, max_tokens=count, sampler=lambda x: mx.argmax(x, axis=-1)
    )
    return [int(token) for token, _ in steps]


def test_greedy_tokens_are_the_same_with_the_fast_kernels_on_and_off(tiny_model, monkeypatch):
    if not fast_modules(tiny_model.model):
        pytest.skip("the fast kernels are switched off here")
    fast_calls, small_calls = set(), []
    converted, original = attention._additive_mask, base.scaled_dot_product_attention

    def fast(mask, scale, queries, keys):  # the fast path's calls, by mask kind
        kind = mask if mask is None or isinstance(mask, str) else str(mask.dtype)
        fast_calls.add((kind, "prefill" if queries.shape[2] > 1 else "decode"))
        return converted(mask, scale, queries, keys)

    def theirs(queries, keys, *args, **kwargs):  # the plain model has its own reference
        small_calls.append(math.prod(queries.shape[:3]) * keys.shape[2])
        return original(queries, keys, *args, **kwargs)

    fused = attention.fused_kernel()

    class FusedSpy:  # the fused kernel's calls (decode steps, short blocks), by mask kind
        MAX_ROWS, MAX_DIM = fused.MAX_ROWS, fused.MAX_DIM

        def decode_attention(self, queries, keys, values, mask, *args):
            kind = "fused " + ("none" if mask is None else str(mask.dtype))
            fast_calls.add((kind, "prefill" if queries.shape[2] > 1 else "decode"))
            return fused.decode_attention(queries, keys, values, mask, *args)

    monkeypatch.setattr(attention, "_additive_mask", fast)
    monkeypatch.setattr(attention, "fused_kernel", FusedSpy)
    monkeypatch.setattr(base, "scaled_dot_product_attention", theirs)
    model_type = "llama" if tiny_model.info.name == "tiny-llama" else "qwen3_next"
    plain_model, _ = mlx_load_model(build_tiny_model(model_type=model_type, tokenizer="qwen3"))
    assert fast_modules(plain_model) == []
    plain = replace(tiny_model, model=plain_model)
    rng = random.Random(5)
    vocab = tiny_model.info.vocab_size
    prompts = [[rng.randrange(1000, vocab - 1000) for _ in range(n)] for n in (1, 30, 90, 150)]
    # mlx-lm's loop: a KVCache, "causal" prefill masks and none at decode.
    for prompt in prompts[1:]:
        assert greedy_tokens(tiny_model.model, prompt, 12) == greedy_tokens(plain_model, prompt, 12)
    # Orchard's engine: prompts prefilled together (left-padded, bool masks), then decoded in
    # one BatchKVCache (4 rows x 4 heads x ~160 keys: the fast path), a row joining later.
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    requests = [make_request(f"g{i}", p, params) for i, p in enumerate(prompts)]
    ours = run_batched(tiny_model, requests, join_at=[0, 0, 0, 3])
    theirs = run_batched(plain, requests, join_at=[0, 0, 0, 3])
    for request in requests:
        assert ours.tokens(request.request_id) == theirs.tokens(request.request_id)
    assert {("causal", "prefill"), ("mlx.core.bool", "prefill")} <= fast_calls
    assert ("fused mlx.core.bool", "decode") in fast_calls
    assert small_calls == []  # what the ops path finds too small, the fused kernel takes
