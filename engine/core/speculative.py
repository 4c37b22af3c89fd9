"""Speculative decoding: drafts by prompt lookup from the sequence's own tokens, or from a
draft model (engine/core/draft_model.py), checked in one forward of the served model.

Agents, code edits and summaries repeat their input; a sequence whose last few tokens occurred
before is likely to continue as it did then. `NgramDrafter` finds the most recent earlier
occurrence of the sequence's last `n` tokens (the longest `n` from `max_ngram` down to
`min_ngram`) and proposes the tokens that followed it. The batch runner feeds each row's last
token and its draft in one forward and keeps the longest prefix of the draft that the model
would have produced itself (engine/core/forward.py), so a step yields 1 to 1 + len(draft) tokens.

Exactness. Each position's token is sampled from the target model's distribution exactly as an
unspeculated step would sample it (same processing, same counter-based uniform: the draft
only decides how many positions are computed in one forward), and a draft token is accepted
when it equals that sample. For a draft that is a single proposed token (a point mass, as
prompt lookup gives) this is rejection sampling's acceptance rule: the draft is kept with
probability p(draft), and on rejection the emitted token is distributed as p restricted to
the other tokens — so the output distribution is the model's, and a seeded request gives the
same tokens with and without speculation; greedy rows the same argmax.

Policy (`Speculator`): which rows draft and how far. A row drafts only when its sampling needs
no host decision between positions (no penalties, no grammar), only while its drafts keep
being accepted (an acceptance average per sequence: a row whose drafts keep failing stops
drafting, and tries again after a cool-down). Every row of a batch is fed as many positions
as the longest draft, so a wide batch pays for its drafts in every row: whether drafting pays
off is measured, per batch size (in powers of two), as tokens per second of the decode steps
with drafts against those without (every `PROBE_EVERY`th step of a size decodes without, to
keep that figure fresh; a size's first steps are plain until one is measured); a size whose
drafted steps are slower stops drafting, except every
`PROBE_EVERY`th step, which drafts to see whether that changed. Batches above `max_rows` (4)
never draft: on the 2-core CPU a batch of 16 rows was 0.78x as fast with drafts as without
even at 87% acceptance (bench/RESULTS.md), every row paying for the widest draft.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from engine.core.request import Sequence


class NgramDrafter:
    """An index of one sequence's n-grams (most recent end position of each), kept up to
    date incrementally: proposing costs O(max_ngram) dictionary lookups plus the draft."""

    def __init__(self, *, min_ngram: int, max_ngram: int):
        self.min_ngram = min_ngram
        self.max_ngram = max_ngram
        self._last_end: dict[tuple[int, ...], int] = {}
        self._indexed = 0  # n-grams ending before this position are in the index

    def propose(self, tokens: Seq[int], num_tokens: int) -> tuple[int, ...]:
        """Up to `num_tokens` tokens that followed the latest earlier occurrence of the
        longest suffix of `tokens` found in the index; () when none occurred."""
        length = len(tokens)
        if num_tokens <= 0 or length < self.min_ngram + 1:
            return ()
        # Index every n-gram that ends before the current last token, so the suffix itself
        # (ending at length - 1) is never its own match.
        for end in range(self._indexed, length - 1):
            for n in range(self.min_ngram, self.max_ngram + 1):
                if end + 1 >= n:
                    self._last_end[tuple(tokens[end + 1 - n : end + 1])] = end
        self._indexed = max(self._indexed, length - 1)
        for n in range(min(self.max_ngram, length - 1), self.min_ngram - 1, -1):
            end = self._last_end.get(tuple(tokens[length - n :]))
            if end is not None:
                return tuple(tokens[end + 1 : end + 1 + num_tokens])
        return ()


@dataclass
class _RowStats:
    drafter: NgramDrafter
    acceptance: float = 1.0  # moving average of accepted / drafted tokens
    resume_at: int = 0  # while failing: the step count at which it may draft again


@dataclass
class Speculator:
    """Chooses each step's drafts (see the module docstring).

    `num_tokens`: the longest draft; `max_rows`: the largest decode batch that speculates;
    a row stops drafting while its acceptance average is below `min_acceptance`, for
    `cooldown_steps` steps."""

    num_tokens: int
    max_rows: int = 4
    draft_model: bool = False  # a draft model proposes (engine/core/draft_model.py), not lookup
    min_ngram: int = 2
    max_ngram: int = 4
    min_acceptance: float = 0.3
    cooldown_steps: int = 16
    adaptive: bool = True  # refuse drafts where measured slower (tests turn it off)
    num_drafted: int = 0
    num_accepted: int = 0
    _rows: dict[tuple[str, int], _RowStats] = field(default_factory=dict)
    _steps: int = 0
    # Per batch size bucket: [steps, tokens/s without drafts, tokens/s with drafts].
    _rates: dict[int, list] = field(default_factory=dict)

    PROBE_EVERY = 24
    RATE_WEIGHT = 0.25  # of a new step in the moving averages

    def drafts(self, decode: list[Sequence]) -> dict[int, tuple[int, ...]]:
        """The prompt-lookup draft of each decode row that drafts this step, by `id(seq)`
        (none when a draft model proposes: see `draft_lengths`)."""
        if self.draft_model:
            return {}
        out: dict[int, tuple[int, ...]] = {}
        for seq, stats, length in self._drafting(decode):
            tokens = (*seq.request.prompt_token_ids, *seq.output_token_ids)
            draft = stats.drafter.propose(tokens, length)
            if draft:
                out[id(seq)] = draft
        return out

    def draft_lengths(self, decode: list[Sequence]) -> dict[int, int]:
        """With a draft model: how many tokens it drafts for each row that drafts this step, by
        `id(seq)` (the engine has it propose them before the step runs)."""
        if not self.draft_model:
            return {}
        return {id(seq): length for seq, _, length in self._drafting(decode)}

    def _drafting(self, decode: list[Sequence]) -> list[tuple[Sequence, _RowStats, int]]:
        """The rows that draft this step, with their stats and the longest draft each may
        have. Called once a step."""
        self._steps += 1
        if not decode or len(decode) > self.max_rows or self.num_tokens <= 0:
            return []
        if self.adaptive and not self._pays_off(len(decode)):
            return []
        out = []
        for seq in decode:
            if seq.constraint is not None or seq.sampling_state.depends_on_history:
                continue
            if seq.request.spec.images:  # its prompt holds image positions, not tokens to draft
                continue
            stats = self._rows.get(seq.seq_id)
            if stats is None:
                drafter = NgramDrafter(min_ngram=self.min_ngram, max_ngram=self.max_ngram)
                stats = self._rows[seq.seq_id] = _RowStats(drafter)
            if self._steps < stats.resume_at:
                continue
            # Never past max_tokens: the last token a row may emit comes from its own position.
            room = seq.request.max_tokens - len(seq.output_token_ids) - 1
            if room > 0:
                out.append((seq, stats, min(self.num_tokens, room)))
        return out

    def record(self, decode: list[Sequence], drafts: dict, accepted: dict[int, int]) -> None:
        """After a step: each drafting row's acceptance (`accepted` by `id(seq)`)."""
        for seq in decode:
            draft = drafts.get(id(seq))
            if not draft:
                continue
            stats = self._rows.get(seq.seq_id)
            num = accepted.get(id(seq), 0)
            self.num_drafted += len(draft)
            self.num_accepted += num
            if stats is None:
                continue
            stats.acceptance = 0.6 * stats.acceptance + 0.4 * (num / len(draft))
            if stats.acceptance < self.min_acceptance:
                stats.resume_at = self._steps + self.cooldown_steps
                stats.acceptance = self.min_acceptance  # one good draft brings it back

    def _pays_off(self, num_rows: int) -> bool:
        rates = self._rates.setdefault(num_rows.bit_length(), [0, None, None])
        rates[0] += 1
        plain, drafted = rates[1], rates[2]
        if plain is None or drafted is None:
            # Measure a plain step of this size first (what a step costs anyway), then one
            # with drafts: a short burst must not pay for drafts that lose all along.
            return plain is not None
        losing = drafted < plain
        # A probe step does what the figures advise against, so both stay measured.
        return losing == (rates[0] % self.PROBE_EVERY == 0)

    def record_step(self, num_rows: int, drafted: bool, num_tokens: int, seconds: float) -> None:
        """A decode-only step's throughput, for the per-batch-size comparison."""
        rates = self._rates.get(num_rows.bit_length())
        if rates is None or seconds <= 0 or num_rows > self.max_rows:
            return
        slot = 2 if drafted else 1
        rate = num_tokens / seconds
        previous = rates[slot]
        weight = self.RATE_WEIGHT
        rates[slot] = rate if previous is None else (1 - weight) * previous + weight * rate

    def forget(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            self._rows.pop(seq.seq_id, None)
