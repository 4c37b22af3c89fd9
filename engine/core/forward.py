"""The model calls the runners make: prompt tokens into a cache, the logits of chosen positions
only, a decode step sampled, and one forward that checks speculative drafts.

Apart from engine/core/runner.py, which keeps the decode batch's rows and caches in step with the
scheduler's plan: this module computes, the runner decides what for. Nothing here keeps state
between calls; the caches it is given are the runner's.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import engine  # noqa: F401  (OpenBLAS before mlx)

# isort: split
import mlx.core as mx
import mlx.nn as nn

from engine.cache.mlx_caches import Cache, make_cache
from engine.core.request import Sequence
from engine.core.sampled import Sampled, collect, result_arrays, sample_rows
from engine.core.sampling import SampleResult
from engine.models import mrope


def prefill(
    model: nn.Module, cache: Cache, token_ids: Seq[int], embeddings: mx.array | None = None
) -> None:
    """Run tokens through the model into `cache`, fed as ids or as their input `embeddings`
    (a prompt with images: engine/models/vision.py); the logits are never materialised."""
    if token_ids:
        model(mx.array(token_ids)[None], cache=cache, **fed(embeddings))
        # Logits of prefill chunks are left unevaluated (lazy), so the vocabulary projection
        # of every prompt position is never computed.
        mx.async_eval([c.state for c in cache])


def fed(embeddings: mx.array | None) -> dict:
    """The model's keyword for input embeddings fed instead of ids (mlx-lm's), where given."""
    return {} if embeddings is None else {"input_embeddings": embeddings}


def last_logits(model: nn.Module) -> Callable[..., mx.array]:
    """`forward(tokens (B, T), cache, positions, rows=None, embeddings=None)`: the logits
    (N, V) of position `positions[i]` of row `rows[i]` (rows None: one position per row, in
    row order); fed `embeddings` (B, T, hidden) instead of the tokens' own where given.

    The model's own call projects every position through the vocabulary; a prompt whose
    first token comes from its prefill needs one. mlx-lm models are a backbone (`model`)
    and a head (`lm_head`, or the embedding's transpose when tied), so where a probe shows
    that backbone-then-head gives the model's own logits, only the wanted rows are projected;
    otherwise (a model that post-processes its logits) the model is called whole."""

    def picked(rows: list[int] | None, tokens: mx.array) -> mx.array:
        return mx.arange(tokens.shape[0]) if rows is None else mx.array(rows)

    def whole(
        tokens: mx.array, cache: Cache, positions: list[int], rows=None, embeddings=None
    ) -> mx.array:
        logits = model(tokens, cache=cache, **fed(embeddings))
        return logits[picked(rows, tokens), mx.array(positions)]

    backbone = getattr(model, "model", None)
    if getattr(model, "lm_head", None) is not None:
        head = model.lm_head
    elif hasattr(getattr(backbone, "embed_tokens", None), "as_linear"):
        head = backbone.embed_tokens.as_linear
    else:
        return whole

    def split(
        tokens: mx.array, cache: Cache, positions: list[int], rows=None, embeddings=None
    ) -> mx.array:
        hidden = backbone(tokens, cache, **fed(embeddings))
        return head(hidden[picked(rows, tokens), mx.array(positions)])

    try:
        probe = mx.array([[1, 2, 3, 4]])
        expected = whole(probe, make_cache(model), [3])
        if mx.allclose(split(probe, make_cache(model), [3]), expected, rtol=1e-4, atol=1e-4):
            return split
    except Exception:  # a backbone with another signature: call the model whole
        pass
    return whole


def sample_first(logits: mx.array, seqs: list[Sequence]) -> SampleResult:
    """The first token of each sequence from its prompt's last logits (one row per
    sequence; the n choices of a request share their prompt's row)."""
    if logits.shape[0] != len(seqs):
        rows = [seq.request for seq in seqs]
        requests = list(dict.fromkeys(id(r) for r in rows))
        logits = logits[mx.array([requests.index(id(r)) for r in rows])]
    result = sample_rows(logits, seqs)
    mx.async_eval(result_arrays(result))
    return result


def decode(
    model: nn.Module,
    seqs: list[Sequence],
    cache: Cache,
    num_ahead: int,
    inputs: mx.array | None = None,
) -> SampleResult:
    """One decode step of `seqs` (the rows of `cache`), fed their last tokens or `inputs`."""
    if inputs is None:
        inputs = mx.array([seq.token_at(seq.num_tokens - 1) for seq in seqs])
    with mrope.rows(model, seqs):
        logits = model(inputs[:, None], cache=cache)[:, -1, :]
    result = sample_rows(logits, seqs, num_ahead)
    mx.async_eval(result_arrays(result))
    return result


@dataclass
class Verify:
    """A speculative decode step in flight: the rows, their drafts (by id(seq)), the width
    fed per row, and per position the rows that drafted that far with their samples."""

    seqs: list[Sequence]
    drafts: dict[int, tuple[int, ...]]
    width: int
    positions: list[tuple[list[int], SampleResult]]


def decode_drafts(
    forward: Callable[..., mx.array],
    seqs: list[Sequence],
    cache: Cache,
    drafts: dict[int, tuple[int, ...]],
) -> Verify:
    """One forward (`last_logits`) of every row's last token and its draft (rows with a shorter
    draft padded with repeats of their last token), each position sampled as an unspeculated
    step would sample it (engine/core/speculative.py)."""
    width = 1 + max(len(draft) for draft in drafts.values())
    rows = []
    for seq in seqs:
        last = seq.token_at(seq.num_tokens - 1)
        draft = drafts.get(id(seq), ())
        rows.append([last, *draft, *[last] * (width - 1 - len(draft))])
    # Only the positions that are sampled go through the vocabulary projection: every
    # row's first, and a drafting row's as far as its draft.
    kept = [
        [r for r, seq in enumerate(seqs) if len(drafts.get(id(seq), ())) >= j] for j in range(width)
    ]
    flat_rows = [r for rows_j in kept for r in rows_j]
    flat_positions = [j for j, rows_j in enumerate(kept) for _ in rows_j]
    logits = forward(mx.array(rows), cache, flat_positions, flat_rows)
    positions, start = [], 0
    for j, rows_j in enumerate(kept):
        part = logits[start : start + len(rows_j)]
        start += len(rows_j)
        positions.append((rows_j, sample_rows(part, [seqs[r] for r in rows_j], j)))
    mx.async_eval([a for _, result in positions for a in result_arrays(result)])
    return Verify(seqs, drafts, width, positions)


def accept_drafts(verify: Verify, cache: Cache, accepted: dict[int, int]) -> list[Sampled]:
    """Each row's tokens: its position-0 token, then one more per draft token equal to
    the token sampled before it; the rejected positions are dropped from the cache, and how
    many draft tokens each drafting row kept goes in `accepted` (by id(seq))."""
    seqs = verify.seqs
    by_position: list[dict[int, Sampled]] = []
    for kept, result in verify.positions:
        sampled = collect([([seqs[r] for r in kept], result)])
        by_position.append(dict(zip(kept, sampled, strict=True)))
    out: list[Sampled] = []
    garbage = []
    for r, seq in enumerate(seqs):
        draft = verify.drafts.get(id(seq), ())
        emitted = [by_position[0][r]]
        while len(emitted) <= len(draft) and draft[len(emitted) - 1] == emitted[-1].token_id:
            emitted.append(by_position[len(emitted)][r])
        num_accepted = len(emitted) - 1
        if draft:
            accepted[id(seq)] = num_accepted
        out += emitted
        garbage.append(verify.width - 1 - num_accepted)
    common = min(garbage)
    for layer in cache:
        if common:
            layer.trim(common)
        if max(garbage) > common:
            # mlx-lm's right-padding roll: each row's rejected positions move into its
            # left padding, which the mask hides.
            layer.prepare(right_padding=[g - common for g in garbage])
            layer.finalize()
    return out
