"""The one module that touches mlx-lm's model call and cache classes.

mlx-lm's batching internals move between releases; everything Orchard needs from them is here,
so an upgrade touches this file only. The runner computes what the scheduler decided and makes
no policy. Only the engine thread of a model calls into it.

Batching follows mlx-lm's own scheme: each prompt is prefilled alone (batch 1, no padding, so
its numbers are those of a lone request), all but its last token; its cache then joins the
decode batch (`BatchKVCache` / `ArraysCache` merge and extend, left padding), and its last
prompt token is fed with the decode step, whose last-position logits give its first token.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any

import engine  # noqa: F401  (OpenBLAS before mlx)

# isort: split
import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from engine.request import Sequence
from engine.sampling import sample_batch
from engine.scheduler import SchedulerOutput

Cache = list[Any]
# A JSON-mode row whose sampled token is invalid picks the best allowed one among this many.
CANDIDATES = 128


@dataclass(frozen=True)
class Sampled:
    """One token sampled for one sequence, with host-side logprobs when asked for."""

    seq: Sequence
    token_id: int
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] = ()


def make_cache(model: nn.Module) -> Cache:
    return make_prompt_cache(model)


def prefill(model: nn.Module, cache: Cache, token_ids: Seq[int]) -> None:
    """Run tokens through the model into `cache`; the logits are never materialised."""
    if token_ids:
        model(mx.array(token_ids)[None], cache=cache)
        # Logits of prefill chunks are left unevaluated (lazy), so the vocabulary projection
        # of every prompt position is never computed.
        mx.async_eval([c.state for c in cache])


def sample(logits: mx.array, seqs: list[Sequence]) -> list[Sampled]:
    """Sample one token per row of `logits` (B, V) and bring the results to the host at once."""
    result = sample_batch(logits, [seq.sampling_state for seq in seqs])
    arrays = [result.token_ids]
    if result.logprobs is not None:
        arrays.append(result.logprobs)
    if result.top_ids is not None:
        arrays += [result.top_ids, result.top_logprobs]
    mx.eval(arrays)
    token_ids = result.token_ids.tolist()
    logprobs = result.logprobs.tolist() if result.logprobs is not None else None
    top_ids = result.top_ids.tolist() if result.top_ids is not None else None
    top_logprobs = result.top_logprobs.tolist() if result.top_ids is not None else None
    if any(seq.constraint is not None for seq in seqs):
        _constrain(result.logits, seqs, token_ids, logprobs)
    out = []
    for row, seq in enumerate(seqs):
        params = seq.sampling_state.params
        if not params.logprobs or logprobs is None:
            out.append(Sampled(seq, token_ids[row]))
            continue
        num_top = params.top_logprobs
        top = (
            tuple(zip(top_ids[row][:num_top], top_logprobs[row][:num_top], strict=True))
            if top_ids
            else ()
        )
        out.append(Sampled(seq, token_ids[row], logprobs[row], top))
    return out


def _constrain(
    logits: mx.array, seqs: list[Sequence], token_ids: list[int], logprobs: list[float] | None
) -> None:
    """Replace, in place, each constrained row's token that its constraint does not allow.

    Only rows that need it touch the device again: those whose token is invalid rank their
    `CANDIDATES` most likely tokens (the logprob distribution) and take the first allowed one.
    """
    replaced: dict[int, int | None] = {}  # row -> its replacement; None: rank candidates
    for row, seq in enumerate(seqs):
        constraint = seq.constraint
        if constraint is None:
            continue
        forced = constraint.forced_token(seq.request.max_tokens - len(seq.output_token_ids))
        if forced is not None:
            if forced != token_ids[row]:
                replaced[row] = forced
        elif not constraint.allows(token_ids[row]):
            replaced[row] = None
    if not replaced:
        return
    ranked = [row for row, token in replaced.items() if token is None]
    if ranked:
        num = min(CANDIDATES, logits.shape[-1])
        rows = logits[mx.array(ranked)]
        candidates = mx.argpartition(-rows, num - 1, axis=-1)[:, :num]
        order = mx.argsort(-mx.take_along_axis(rows, candidates, axis=-1), axis=-1)
        ranked_ids = mx.take_along_axis(candidates, order, axis=-1).tolist()
        for row, ids in zip(ranked, ranked_ids, strict=True):
            constraint = seqs[row].constraint
            replaced[row] = next(
                (t for t in ids if constraint.allows(t)), constraint.forced_token(0)
            )
    for row, token in replaced.items():
        token_ids[row] = token
    if logprobs is not None:
        rows = mx.array(list(replaced))
        chosen = mx.array(list(replaced.values()))[:, None]
        picked = logits[rows].astype(mx.float32)
        values = mx.take_along_axis(picked, chosen, axis=-1)[:, 0] - mx.logsumexp(picked, axis=-1)
        for row, value in zip(replaced, values.tolist(), strict=True):
            logprobs[row] = value


class BatchRunner:
    """Holds the decode batch (rows, batched cache) and in-progress prefill caches."""

    def __init__(self, model: nn.Module):
        self.model = model
        self._rows: list[Sequence] = []
        self._cache: Cache | None = None
        self._prefill_caches: dict[str, Cache] = {}

    @property
    def num_rows(self) -> int:
        return len(self._rows)

    def release(self, request_id: str) -> None:
        """Forget a request's prefill cache (aborted before its prompt was done)."""
        self._prefill_caches.pop(request_id, None)

    def release_finished(self) -> None:
        """Drop the decode rows of finished sequences, freeing their cache."""
        self._keep_rows([i for i, seq in enumerate(self._rows) if not seq.status.is_finished])

    def reset(self) -> None:
        self._rows, self._cache, self._prefill_caches = [], None, {}

    def execute(self, plan: SchedulerOutput) -> list[Sampled]:
        assert [id(seq) for seq in self._rows] == [id(seq) for seq in plan.decode], (
            "rows out of sync"
        )
        joining: list[Sequence] = []
        joining_caches: list[Cache] = []
        for chunk in plan.prefill:
            request = chunk.request
            cache = self._prefill_caches.setdefault(request.request_id, make_cache(self.model))
            end = chunk.start + chunk.num_tokens
            if not chunk.completes_prompt:
                prefill(self.model, cache, request.prompt_token_ids[chunk.start : end])
                continue
            prefill(self.model, cache, request.prompt_token_ids[chunk.start : end - 1])
            del self._prefill_caches[request.request_id]
            for seq in request.live_sequences():
                joining.append(seq)
                joining_caches.append(cache)
        if joining:
            self._join(joining, joining_caches)
        if not self._rows:
            return []
        inputs = mx.array([seq.token_at(seq.num_tokens - 1) for seq in self._rows])
        logits = self.model(inputs[:, None], cache=self._cache)[:, -1, :]
        return sample(logits, self._rows)

    def _keep_rows(self, keep: list[int]) -> None:
        if len(keep) == len(self._rows):
            return
        if not keep:
            self._rows, self._cache = [], None
            return
        self._rows = [self._rows[i] for i in keep]
        for layer in self._cache:
            layer.filter(keep)

    def _join(self, seqs: list[Sequence], caches: list[Cache]) -> None:
        # Merging copies, so n choices forked from one prompt cache get independent rows.
        merged = [type(layers[0]).merge(list(layers)) for layers in zip(*caches, strict=True)]
        if self._cache is None:
            self._cache = merged
        else:
            for layer, new in zip(self._cache, merged, strict=True):
                layer.extend(new)
        self._rows.extend(seqs)


class SequenceRunner:
    """One sequence at a time with mlx-lm's plain caches: for models that cannot batch."""

    def __init__(self, model: nn.Module):
        self.model = model

    def prefill(self, token_ids: Seq[int], chunk_size: int) -> Cache:
        """A cache holding all but the last of `token_ids`, computed in chunks."""
        cache = make_cache(self.model)
        body = token_ids[:-1]
        for start in range(0, len(body), chunk_size):
            prefill(self.model, cache, body[start : start + chunk_size])
        return cache

    def step(self, cache: Cache, seqs: list[Sequence]) -> list[Sampled]:
        """Feed each sequence's last token (one shared cache, so one sequence) and sample."""
        (seq,) = seqs
        logits = self.model(mx.array([[seq.token_at(seq.num_tokens - 1)]]), cache=cache)
        return sample(logits[:, -1, :], seqs)
