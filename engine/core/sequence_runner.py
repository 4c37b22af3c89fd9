"""The simple engine's runner (engine/core/simple.py): one sequence at a time with mlx-lm's plain
caches, for models that cannot batch. Its prefix-cache behaviour is the batch runner's
(engine/core/runner.py): seeded from a hit, checkpoints, the prompt and finished sequences
inserted."""

from __future__ import annotations

import engine  # noqa: F401  (OpenBLAS before mlx)

# isort: split
import mlx.core as mx
import mlx.nn as nn

from engine.cache.mlx_caches import Cache, KVQuant, remember, start_cache
from engine.cache.prefix import PrefixCache
from engine.core.forward import last_logits, prefill
from engine.core.request import Sequence
from engine.core.runner import KEPT
from engine.core.sampled import Sampled, sample


class SequenceRunner:
    """One sequence at a time with mlx-lm's plain caches: for models that cannot batch. It
    shares the batch runner's prefix cache behaviour: seeded from a hit, checkpoints and the
    prompt and finished sequences inserted."""

    def __init__(
        self,
        model: nn.Module,
        prefix_cache: PrefixCache | None = None,
        *,
        hybrid: bool = False,
        quant: KVQuant | None = None,
    ):
        self.model = model
        self.prefix_cache = prefix_cache
        self.hybrid = hybrid
        self.quant = quant  # the keys' and values' quantization (None: none)
        self._last_logits = last_logits(model)

    def drop(self) -> None:
        """Let go of the model's arrays (its engine has ended): the forward closes over them."""
        self.model = self.prefix_cache = self._last_logits = None

    def prefill(self, seq: Sequence, chunk_size: int) -> tuple[Cache, list[Sampled]]:
        """The cache of `seq`'s prompt, computed in chunks that end at its checkpoints, from a
        prefix-cache hit when there is one; and its first token, sampled from the last chunk
        (as the batch runner does; on a hybrid model the last prompt token is left to `step`
        and this returns no token)."""
        request = seq.request
        prompt = request.prompt_token_ids
        hit = None
        scope = request.cache_scope
        if self.prefix_cache is not None:
            hit = self.prefix_cache.match(prompt, limit=len(prompt) - 1, scope=scope)
            request.num_cached_tokens = hit.length
        room = len(prompt) - (hit.length if hit else 0)
        cache = start_cache(self.model, None, hit, room, self.quant)
        start = hit.length if hit is not None else 0
        stop = len(prompt) - 1 if self.hybrid else len(prompt)
        logits = None
        while start < stop:
            end = min(stop, start + chunk_size)
            end = next((c for c in request.checkpoints if start < c < end), end)
            if end < len(prompt):
                prefill(self.model, cache, prompt[start:end])
            else:
                tokens = mx.array(prompt[start:end])[None]
                logits = self._last_logits(tokens, cache, [end - start - 1])
            if end in request.checkpoints:
                remember(self.prefix_cache, prompt[:end], cache, scope=scope, hybrid=self.hybrid)
            start = end
        remember(self.prefix_cache, prompt[:stop], cache, scope=scope, hybrid=self.hybrid)
        return cache, [] if logits is None else sample(logits, [seq])

    def finished(self, seq: Sequence, cache: Cache) -> None:
        """Keep a sequence that ended normally (its computed tokens) in the prefix cache."""
        if self.prefix_cache is not None and seq.status in KEPT:
            tokens = seq.request.prompt_token_ids + tuple(seq.output_token_ids)
            remember(
                self.prefix_cache,
                tokens[: seq.num_computed_tokens],
                cache,
                scope=seq.request.cache_scope,
                hybrid=self.hybrid,
            )

    def step(self, cache: Cache, seqs: list[Sequence]) -> list[Sampled]:
        """Feed each sequence's last token (one shared cache, so one sequence) and sample."""
        (seq,) = seqs
        logits = self.model(mx.array([[seq.token_at(seq.num_tokens - 1)]]), cache=cache)
        return sample(logits[:, -1, :], seqs)
