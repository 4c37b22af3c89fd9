"""Speculative decoding with a draft model: a smaller model of the same tokenizer proposes the
next tokens of each drafting sequence, and the batch runner checks them in one forward of the
served model (engine/core/forward.py), as it checks prompt-lookup drafts.

The draft model proposes greedily: each draft is a point, and a draft token is kept when it
equals the token the served model samples at its position, with that position's own sampling
(engine/core/speculative.py). That is rejection sampling's rule for a proposal that puts all its
mass on one token, so outputs keep the served model's distribution at any temperature, and a
seeded request gives the same tokens with and without drafts (what a draft distribution's
min(1, p/q) rule would give up for a higher acceptance).

Each sequence that drafts has the draft model's own cache, holding the tokens it was fed. On
each draft the cache is cut back to what still agrees with the sequence (the served model
rejected the rest) and fed what it has not seen (the whole prompt the first time), one row at a
time; then the drafting rows generate together, their caches merged into one batch for the
draft's steps and taken apart again. Only the model's engine thread calls it.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import engine  # noqa: F401  (OpenBLAS before mlx)

# isort: split
import mlx.core as mx
import mlx.nn as nn

from engine.cache import mlx_caches as caches
from engine.cache.mlx_caches import Cache
from engine.core.request import Sequence
from engine.models.loader import LoadedModel

# The draft model reads a sequence it has not seen in pieces of at most this many tokens.
FEED_CHUNK_TOKENS = 512


class DraftModelError(ValueError):
    """The registry's draft model cannot draft for this model."""


@dataclass
class _Row:
    cache: Cache
    fed: list[int] = field(default_factory=list)  # the tokens in `cache`, in order


class DraftModel:
    def __init__(self, loaded: LoadedModel, *, target: LoadedModel):
        check_compatible(loaded, target)
        self.model: nn.Module = loaded.model
        self.name = loaded.info.name
        self._rows: dict[tuple[str, int], _Row] = {}

    def draft(self, seqs: Seq[Sequence], lengths: Seq[int]) -> list[tuple[int, ...]]:
        """Greedy drafts of `lengths[i]` tokens continuing each sequence's tokens."""
        rows = [self._caught_up(seq) for seq in seqs]
        steps = max(lengths)
        batch = caches.merge([row.cache for row in rows])
        inputs = [seq.token_at(seq.num_tokens - 1) for seq in seqs]
        generated: list[list[int]] = [[] for _ in seqs]
        for _ in range(steps):
            logits = self.model(mx.array(inputs)[:, None], cache=batch)[:, -1, :]
            inputs = mx.argmax(logits, axis=-1).tolist()
            for out, token in zip(generated, inputs, strict=True):
                out.append(token)
        for index, (seq, row) in enumerate(zip(seqs, rows, strict=True)):
            row.cache = [layer.extract(index) for layer in batch]
            row.fed.append(seq.token_at(seq.num_tokens - 1))
            row.fed += generated[index][:-1]
        return [tuple(out[:length]) for out, length in zip(generated, lengths, strict=True)]

    def _caught_up(self, seq: Sequence) -> _Row:
        """The sequence's draft cache holding all of its tokens but the last."""
        row = self._rows.get(seq.seq_id)
        if row is None:
            row = self._rows[seq.seq_id] = _Row(caches.make_cache(self.model))
        tokens = (*seq.request.prompt_token_ids, *seq.output_token_ids)[: seq.num_tokens - 1]
        agree = 0
        for fed, token in zip(row.fed, tokens, strict=False):
            if fed != token:
                break
            agree += 1
        if agree < len(row.fed):
            for layer in row.cache:
                layer.trim(len(row.fed) - agree)
            del row.fed[agree:]
        for start in range(agree, len(tokens), FEED_CHUNK_TOKENS):
            piece = tokens[start : start + FEED_CHUNK_TOKENS]
            self.model(mx.array(piece)[None], cache=row.cache)
            row.fed += piece
        mx.eval([layer.state for layer in row.cache if layer.keys is not None])
        return row

    def forget(self, seqs: Seq[Sequence]) -> None:
        for seq in seqs:
            self._rows.pop(seq.seq_id, None)

    def reset(self) -> None:
        self._rows.clear()


def check_compatible(draft: LoadedModel, target: LoadedModel) -> None:
    """A draft model must read and write the same tokens as the model it drafts for, and keep
    only attention caches (a rejected draft is cut from them; recurrent state cannot be)."""
    if _vocab(draft) != _vocab(target):
        raise DraftModelError(
            f"The draft model {draft.info.name!r} does not share the tokenizer of "
            f"{target.info.name!r}; a draft model must come from the same family."
        )
    layout = caches.layout(draft.model)
    if layout is None or set(layout.kinds) != {"kv"}:
        raise DraftModelError(
            f"The draft model {draft.info.name!r} keeps state other than attention keys and "
            "values, which a rejected draft cannot be cut from."
        )


def _vocab(loaded: LoadedModel) -> dict[str, int]:
    tokenizer = getattr(loaded.tokenizer, "_tokenizer", loaded.tokenizer)
    return dict(tokenizer.get_vocab())
