"""Which fast kernels a model gets: `install` swaps them into a loaded model's modules, where
`fast_kernels_enabled` says they apply (the package docstring says what each kernel is)."""

from __future__ import annotations

import functools
import logging
import os
import shutil
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import activations as lm_activations
from mlx_lm.models import base as lm_base

from engine.kernels.activation import precise_swiglu, silu, swiglu
from engine.kernels.attention import fused_kernel, scaled_dot_product_attention
from engine.kernels.grouped import grouped
from engine.kernels.rope import FastRoPE, fast_rope

__all__ = [
    "ENV_SWITCH",
    "FastRoPE",
    "fast_kernels_enabled",
    "install",
    "precise_swiglu",
    "scaled_dot_product_attention",
    "silu",
    "swiglu",
]

logger = logging.getLogger(__name__)

ENV_SWITCH = "ORCHARD_FAST_KERNELS"
# Positions a RoPE table covers when the caller names none (the loader passes the context).
DEFAULT_POSITIONS = 4096


def fast_kernels_enabled() -> bool:
    """Whether `install` should patch models: on unless ORCHARD_FAST_KERNELS=0, and only where
    the default device is the CPU and MLX can compile CPU kernels (it runs g++)."""
    if os.environ.get(ENV_SWITCH, "1").strip().lower() in ("0", "false", "off", "no"):
        return False
    if os.environ.get("MLX_DISABLE_COMPILE") or mx.default_device() != mx.cpu:
        return False
    return shutil.which("g++") is not None and _self_check()


@functools.cache
def _self_check() -> bool:
    """Compile and check the kernels once (the first compile runs g++, seconds, then it is cached
    on disk), so that a machine where that fails keeps MLX's kernels instead of failing requests."""
    x = mx.linspace(-100.0, 100.0, 4001)
    q = mx.linspace(-30.0, 30.0, 2 * 32 * 8).reshape(1, 2, 32, 8)  # past attention.MIN_SCORES
    kv = mx.linspace(-1.0, 1.0, 64 * 8).reshape(1, 1, 64, 8)
    try:
        fast = swiglu(x, mx.ones_like(x))  # the kernels the models' MLPs use
        attention = scaled_dot_product_attention(q, kv, kv, None, scale=0.5, mask="causal")
        mx.eval(fast, attention)
    except Exception:
        logger.warning("fast CPU kernels unavailable: they failed to compile", exc_info=True)
        return False
    exact = x * mx.sigmoid(x)
    error = mx.abs(fast - exact) / mx.maximum(mx.abs(exact), 1e-30)
    theirs = mx.fast.scaled_dot_product_attention(q, kv, kv, scale=0.5, mask="causal")
    if (
        mx.max(mx.where(mx.abs(exact) > 1e-30, error, 0.0)).item() > 1e-5
        or not mx.allclose(attention, theirs, rtol=1e-5, atol=1e-6).item()
    ):
        logger.warning("fast CPU kernels off: they disagree with MLX's on this machine")
        return False
    return True


# What mlx-lm's modules call (by these global names) -> what they call instead. Attention reads
# a batch's length cohorts (engine/kernels/grouped.py) with the fast kernels and without them.
_REPLACEMENTS = {
    "swiglu": (lm_activations.swiglu, swiglu),
    "precise_swiglu": (lm_activations.precise_swiglu, precise_swiglu),
    "scaled_dot_product_attention": (
        lm_base.scaled_dot_product_attention,
        grouped(scaled_dot_product_attention),
    ),
}
_GROUPED_ONLY = {
    "scaled_dot_product_attention": (
        lm_base.scaled_dot_product_attention,
        grouped(lm_base.scaled_dot_product_attention),
    ),
}


def install(model: nn.Module, positions: int = DEFAULT_POSITIONS, *, fast: bool = True) -> int:
    """Give every module of `model` whose `__call__` uses one of mlx-lm's functions above the
    fast one, and every plain `nn.RoPE` a table for `positions` positions (the model's context:
    see rope.py); returns how many modules changed. With `fast` False (off the CPU, or the
    fast kernels turned off) only attention changes: mlx-lm's own, reading length cohorts.

    A module is replaced in its parent by a copy of a subclass whose `__call__` is the same code
    with those names bound to the fast functions (parameters are shared, not copied). Per model,
    not by patching mlx-lm's modules: a model loaded under ORCHARD_FAST_KERNELS=0 in the same
    process keeps MLX's kernels. Copies rather than in-place class changes: mlx-lm shares one
    default `SwiGLU()` instance among all its MoE layers, of every model in the process."""
    copies: dict[int, nn.Module] = {}

    def swap(value: Any) -> Any:
        if type(value) is nn.RoPE and fast:
            if id(value) not in copies:
                copies[id(value)] = fast_rope(value, positions)
            return copies[id(value)]
        if isinstance(value, nn.Module):
            if id(value) not in copies:
                copies[id(value)] = _fast_copy(value, fast)
                visit(copies[id(value)])
            return copies[id(value)]
        if isinstance(value, list):
            value[:] = [swap(v) for v in value]
        elif isinstance(value, tuple):
            return tuple(swap(v) for v in value)
        elif isinstance(value, dict):
            for key in value:
                value[key] = swap(value[key])
        return value

    def visit(module: nn.Module) -> None:
        for key in list(module.keys()):
            module[key] = swap(module[key])

    visit(model)
    if fast:
        fused_kernel()  # built and checked now, not in a request's first forward
    return sum(1 for module in copies.values() if getattr(module, "_orchard_fast", False))


def _fast_copy(module: nn.Module, fast: bool = True) -> nn.Module:
    cls = _fast_class(type(module), fast)
    if cls is type(module):
        return module
    copy = cls.__new__(cls)
    dict.update(copy, module)
    copy.__dict__.update(module.__dict__)
    return copy


@functools.cache
def _fast_class(cls: type, fast: bool = True) -> type:
    call = next((vars(k)["__call__"] for k in cls.__mro__ if "__call__" in vars(k)), None)
    code = getattr(call, "__code__", None)
    if (
        code is None
        or getattr(cls, "_orchard_fast", False)
        or getattr(cls, "_orchard_grouped", False)
    ):
        return cls
    swaps = {
        name: replacement
        for name, (original, replacement) in (_REPLACEMENTS if fast else _GROUPED_ONLY).items()
        if name in code.co_names and call.__globals__.get(name) is original
    }
    if not swaps:
        return cls
    fast_call = type(call)(
        code, {**call.__globals__, **swaps}, call.__name__, call.__defaults__, call.__closure__
    )
    fast_call.__kwdefaults__ = call.__kwdefaults__
    fast_call.__qualname__ = call.__qualname__
    return type(
        cls.__name__,
        (cls,),
        {
            "__call__": fast_call,
            "__module__": cls.__module__,
            "__qualname__": cls.__qualname__,
            "_orchard_fast": fast,
            "_orchard_grouped": True,  # its attention reads length cohorts
        },
    )
