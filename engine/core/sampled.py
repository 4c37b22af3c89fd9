"""A step's sampling: each row of a batch's last logits sampled for its sequence (constrained
rows from their grammar's allowed tokens), and the sampled batches brought to the host with one
sync as `Sampled` tokens (with logprobs where asked for)."""

from __future__ import annotations

from dataclasses import dataclass

import engine  # noqa: F401  (OpenBLAS before mlx)

# isort: split
import mlx.core as mx

from engine.core.request import Sequence
from engine.core.sampling import SampleResult, sample_batch
from engine.text.grammar import allowed_tokens


@dataclass(frozen=True)
class Sampled:
    """One token sampled for one sequence, with host-side logprobs when asked for."""

    seq: Sequence
    token_id: int
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] = ()


def sample_rows(logits: mx.array, seqs: list[Sequence], num_ahead: int = 0) -> SampleResult:
    """Sample row i of `logits` (B, V) for `seqs[i]`, constrained rows from their grammar's
    allowed tokens (nothing is evaluated)."""
    allowed = allowed_tokens([seq.constraint for seq in seqs], logits.shape[-1])
    return sample_batch(logits, [seq.sampling_state for seq in seqs], num_ahead, allowed)


def sample(logits: mx.array, seqs: list[Sequence]) -> list[Sampled]:
    """Sample one token per row of `logits` (B, V) and bring the results to the host at once."""
    return collect([(seqs, sample_rows(logits, seqs))])


def result_arrays(result: SampleResult) -> list[mx.array]:
    arrays = [result.token_ids]
    if result.logprobs is not None:
        arrays.append(result.logprobs)
    if result.top_ids is not None:
        arrays += [result.top_ids, result.top_logprobs]
    return arrays


def collect(
    batches: list[tuple[list[Sequence], SampleResult]], keep: set[int] | None = None
) -> list[Sampled]:
    """Bring sampled batches to the host with one sync; rows of sequences whose id is not in
    `keep` (when given) are dropped."""
    mx.eval([array for _, result in batches for array in result_arrays(result)])
    out = []
    for seqs, result in batches:
        rows = [row for row, seq in enumerate(seqs) if keep is None or id(seq) in keep]
        out += _to_host(result, seqs, rows)
    return out


def _to_host(result: SampleResult, seqs: list[Sequence], rows: list[int]) -> list[Sampled]:
    token_ids = result.token_ids.tolist()
    logprobs = result.logprobs.tolist() if result.logprobs is not None else None
    top_ids = result.top_ids.tolist() if result.top_ids is not None else None
    top_logprobs = result.top_logprobs.tolist() if result.top_ids is not None else None
    out = []
    for row in rows:
        seq = seqs[row]
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
