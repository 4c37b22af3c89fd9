"""The runners: the decode batch's rows and caches, kept in step with the scheduler's plan. The
forwards they make (a prefill, a decode step, the logits of chosen positions, a check of drafts)
are in engine/core/forward.py; engine/cache/mlx_caches.py handles mlx-lm's cache objects.

The runner computes what the scheduler decided and makes no policy. Only the engine thread of
a model calls into it.

Batching follows mlx-lm's own scheme: prompts are prefilled, all but their last token, alone
and in chunks, or together (right padding, masked) when several start and end in one step;
their caches then join the decode batch (`BatchKVCache` / `ArraysCache` merge and extend, left
padding), and each last prompt token is fed with the decode step, whose last-position logits
give the first token. In float32 the padded batch changes no greedy token (docs/architecture.md).
The decode batch's attention layers keep their rows in length cohorts (engine/cache/cohorts.py:
each row costs about its own length, not the longest row's) unless the engine turns them off.

With a prefix cache, a request admitted with a hit starts from a cache seeded with it; the state
of every completed prompt (all but its last token), of every prompt checkpoint and of every
sequence that finishes is inserted into the cache for later requests of the same cache scope.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import engine  # noqa: F401  (OpenBLAS before mlx)

# isort: split
import mlx.core as mx
import mlx.nn as nn

from engine.cache.cohorts import wrap
from engine.cache.mlx_caches import Cache, KVQuant, concatenate, merge, remember, start_cache
from engine.cache.prefix import PrefixCache
from engine.core.forward import (
    accept_drafts,
    decode,
    decode_drafts,
    last_logits,
    prefill,
    sample_first,
)
from engine.core.request import Request, Sequence
from engine.core.sampled import Sampled, collect, result_arrays
from engine.core.sampling import SampleResult
from engine.core.scheduler import PrefillChunk, SchedulerOutput
from engine.models import mrope
from engine.models.vision import VisionEncoder
from engine.protocol import RequestStatus

# Finished sequences whose state is worth keeping (an aborted or failed one may be cut short).
KEPT = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH)


@dataclass
class _Prefilled:
    """What a step's prefill completed: sequences still to be fed their last prompt token, in
    the rows of `cache`; and sequences whose first token is already sampled, in the rows of
    `sampled_cache` (in the order of `sampled`)."""

    joining: list[Sequence] = field(default_factory=list)
    cache: Cache | None = None
    sampled: list[tuple[list[Sequence], SampleResult]] = field(default_factory=list)
    sampled_cache: Cache | None = None

    @property
    def arrays(self) -> list:
        """What the prefill computed (caches and first tokens), to wait for."""
        caches = [c for c in (self.cache, self.sampled_cache) if c is not None]
        return [
            *(layer.state for cache in caches for layer in cache),
            *(result_arrays(result) for _, result in self.sampled),
        ]


def _span(embeddings: mx.array | None, start: int, end: int) -> mx.array | None:
    return None if embeddings is None else embeddings[:, start:end]


def _columns(layout: mrope.Layout | None, start: int, end: int) -> mrope.Layout | None:
    return None if layout is None else layout.span(start, end)


class BatchRunner:
    """Holds the decode batch (rows, batched cache) and in-progress prefill caches.

    Running ahead (mlx-lm's `GenerationBatch` overlap): when the caller expects the next step
    to decode the same rows, `execute` builds and starts that step on the device, fed with this
    step's still-lazy token ids, before this step's tokens reach the host. The device then never
    waits for Orchard's host work (sync, stop checks, detokenizing, graph building). A row that
    finishes meanwhile just has its extra token dropped (its cache row goes with it). Rows whose
    next token depends on host decisions (penalty history, a grammar) never run ahead.
    On MLX's CPU backend `mx.async_eval` returns only when the work is done, so there it
    changes the order of work but overlaps nothing (bench/RESULTS.md); Metal and CUDA overlap.
    """

    def __init__(
        self,
        model: nn.Module,
        prefix_cache: PrefixCache | None = None,
        *,
        hybrid: bool = False,
        quant: KVQuant | None = None,
        cohort_pad: int | None = None,
        vision: VisionEncoder | None = None,
    ):
        self.model = model
        self.vision = vision  # a vision model's image encoder (None: text only)
        self.prefix_cache = prefix_cache
        self.hybrid = hybrid
        self.quant = quant  # the keys' and values' quantization (None: none)
        # The decode batch's length cohorts' padding limit (engine/cache/cohorts.py; None:
        # every row at the longest row's length).
        self.cohort_pad = cohort_pad
        self._last_logits = last_logits(model)
        self._rows: list[Sequence] = []
        self._cache: Cache | None = None
        self._prefill_caches: dict[str, Cache] = {}
        self._ahead: tuple[list[Sequence], SampleResult] | None = None
        self.prefill_seconds: float | None = None  # of the last step's prefill

    def drop(self) -> None:
        """Let go of the model's arrays (its engine has ended): the forward closes over them."""
        self.model = self.prefix_cache = self._last_logits = None

    @property
    def num_rows(self) -> int:
        return len(self._rows)

    @property
    def running_ahead(self) -> bool:
        """Whether the next step's decode is already in flight (then it cannot take drafts)."""
        return self._ahead is not None

    def preempt(self, requests: list[Request]) -> None:
        """Take preempted requests out (engine/core/scheduler.py): what each computed goes to
        the prefix cache, where its return finds it, and its rows or prefill cache go."""
        assert self._ahead is None, "no preemption while running ahead"
        gone = set()
        for request in requests:
            request.embeddings = request.layout = None  # computed again on resuming
            if request.spec.images:  # (and so is its vision tower's forward)
                self.vision.prepare(request)
            cache = self._prefill_caches.pop(request.request_id, None)
            lead = request.sequences[0]
            if cache is not None:
                self._remember(
                    request, request.prefill_token_ids[: lead.num_computed_tokens], cache
                )
                continue
            gone |= {id(seq) for seq in request.sequences}
        keep = []
        for row, seq in enumerate(self._rows):
            if id(seq) not in gone:
                keep.append(row)
            elif self.prefix_cache is not None:
                tokens = seq.request.prompt_token_ids + tuple(seq.output_token_ids)
                self._remember(seq.request, tokens[: seq.num_computed_tokens], self._cache, row)
        self._keep_rows(keep)

    def release(self, request_id: str) -> None:
        """Forget a request's prefill cache (aborted before its prompt was done)."""
        self._prefill_caches.pop(request_id, None)

    def release_finished(self) -> None:
        """Drop the decode rows of finished sequences, freeing their cache; those that ended
        normally go to the prefix cache first."""
        keep = []
        ahead = {id(seq) for seq in self._ahead[0]} if self._ahead is not None else set()
        for row, seq in enumerate(self._rows):
            if not seq.status.is_finished:
                keep.append(row)
            elif self.prefix_cache is not None and seq.status in KEPT:
                # A row that ran ahead has also been fed its last sampled token.
                length = seq.num_computed_tokens + (id(seq) in ahead)
                tokens = (seq.request.prompt_token_ids + tuple(seq.output_token_ids))[:length]
                self._remember(seq.request, tokens, self._cache, row)
        self._keep_rows(keep)

    def _remember(self, request: Request, tokens, cache: Cache, row: int | None = None) -> None:
        remember(
            self.prefix_cache,
            tokens,
            cache,
            scope=request.cache_scope,
            row=row,
            hybrid=self.hybrid,
        )

    def reset(self) -> None:
        self._rows, self._cache, self._prefill_caches, self._ahead = [], None, {}, None

    def execute(self, plan: SchedulerOutput, *, run_ahead: bool = False) -> list[Sampled]:
        """Compute `plan` and return its sampled tokens; with `run_ahead`, also start the next
        decode step of the same rows (see the class docstring)."""
        # Rows are keyed by sequence: the batch keeps its own row order (prompts that prefill
        # together join after those that prefill alone), the plan lists the scheduler's.
        # An empty decode with rows: the scheduler paused them for this step's prefill.
        paused = bool(self._rows) and not plan.decode
        assert paused or {id(seq) for seq in self._rows} == {id(seq) for seq in plan.decode}, (
            "rows out of sync"
        )
        assert not (paused and self._ahead is not None), "a step in flight cannot pause"
        started = time.perf_counter()
        done = self._prefill(plan)
        self.prefill_seconds = None
        if plan.prefill:
            # How long the prefill took on its own (the engine sizes prefill chunks from it):
            # on the CPU it is done by now; elsewhere this waits for work the step waits for
            # anyway, before the decode forward is queued.
            partial = [self._prefill_caches.get(chunk.request.request_id) for chunk in plan.prefill]
            mx.eval(done.arrays, [layer.state for c in partial if c is not None for layer in c])
            self.prefill_seconds = time.perf_counter() - started
        batches = []
        verified: list[Sampled] | None = None
        if self._ahead is not None:
            # This step's decode is already running; sequences that finished since are dropped
            # in `collect`, and joining ones get their first token from a forward of their own.
            batches.append(self._ahead)
            self._ahead = None
            if done.joining:
                batches.append((done.joining, decode(self.model, done.joining, done.cache, 0)))
                self._extend(done.joining, done.cache)
        else:
            if done.joining:
                self._extend(done.joining, done.cache)
            if self._rows and plan.drafts:
                # Drafts are checked on the host (how many tokens each row keeps) and the
                # rows' rejected positions leave the cache before other rows join it; no
                # running ahead past such a step.
                rows = list(self._rows)
                with mrope.rows(self.model, rows):
                    verify = decode_drafts(self._last_logits, rows, self._cache, plan.drafts)
                verified = accept_drafts(verify, self._cache, plan.accepted)
            elif self._rows and not paused:
                batches.append((list(self._rows), decode(self.model, self._rows, self._cache, 0)))
        # Prompts whose last token went through their prefill: their first token is sampled,
        # and they decode from the next step on.
        if done.sampled:
            batches += done.sampled
            seqs = [seq for seqs, _ in done.sampled for seq in seqs]
            self._extend(seqs, done.sampled_cache)
        if verified is not None:
            return verified + collect(batches)
        if not batches:
            return []
        if (
            run_ahead
            and not paused
            and not any(
                seq.constraint is not None or seq.sampling_state.depends_on_history
                for seq in self._rows
            )
        ):
            self._ahead = (list(self._rows), self._decode_ahead(batches))
        return collect(batches, keep={id(seq) for seq in self._rows})

    def _prefill(self, plan: SchedulerOutput) -> _Prefilled:
        """Run the plan's prefill chunks. A completed prompt either ran all of its tokens, so
        its first token is sampled from the prefill itself (`sampled`: one forward less
        before the first token), or, on a hybrid model, all but its last (`joining`: that
        token is fed with the decode step, so the prefix cache can keep the recurrent state
        one token before the prompt's end, where a resent prompt resumes).

        Prompts that complete in this step run as one padded batch: from wherever each one's
        cache stands (an earlier chunk, a prefix-cache hit: a shared system prompt makes that
        the common case, or nothing); on a hybrid model only whole prompts (no hit, no earlier
        chunk), whose recurrent state starts empty."""
        whole = [
            chunk
            for chunk in plan.prefill
            if chunk.completes_prompt
            and chunk.num_tokens > 1
            and (chunk.start == 0 or not self.hybrid)
            and chunk.request.embeddings is None  # a prompt with images prefills alone
            and not chunk.request.spec.images
        ]
        together = {id(chunk.request) for chunk in whole} if len(whole) > 1 else set()
        done = _Prefilled()
        joining_caches: list[Cache] = []
        sampled_caches: list[Cache] = []
        for chunk in plan.prefill:
            request = chunk.request
            if id(request) in together:
                continue
            cache = self._prefill_caches.get(request.request_id)
            if cache is None:
                cache = self._prefill_caches[request.request_id] = self._start(request)
            end = chunk.start + chunk.num_tokens
            prompt = request.prefill_token_ids
            embeddings = request.embeddings  # a prompt with images: fed by embedding
            layout = request.layout  # and on an M-RoPE model, at its images' positions
            if not chunk.completes_prompt:
                with mrope.prompt(self.model, _columns(layout, chunk.start, end)):
                    prefill(
                        self.model,
                        cache,
                        prompt[chunk.start : end],
                        _span(embeddings, chunk.start, end),
                    )
                if end in request.checkpoints:
                    self._remember(request, prompt[:end], cache)
                continue
            del self._prefill_caches[request.request_id]
            request.embeddings = request.layout = None
            seqs = request.live_sequences()
            if self.hybrid:
                with mrope.prompt(self.model, _columns(layout, chunk.start, end - 1)):
                    prefill(
                        self.model,
                        cache,
                        prompt[chunk.start : end - 1],
                        _span(embeddings, chunk.start, end - 1),
                    )
                self._remember(request, prompt[: end - 1], cache)
                done.joining += seqs
                joining_caches += [cache] * len(seqs)
                continue
            tokens = mx.array(prompt[chunk.start : end])[None]
            with mrope.prompt(self.model, _columns(layout, chunk.start, end)):
                logits = self._last_logits(
                    tokens,
                    cache,
                    [end - chunk.start - 1],
                    embeddings=_span(embeddings, chunk.start, end),
                )
            self._remember(request, prompt, cache)
            done.sampled.append((seqs, sample_first(logits, seqs)))
            sampled_caches += [cache] * len(seqs)
        done.cache = merge(joining_caches) if joining_caches else None
        done.sampled_cache = merge(sampled_caches) if sampled_caches else None
        if together:
            batch, logits = self._prefill_together(whole)
            seqs = [seq for chunk in whole for seq in chunk.request.live_sequences()]
            if logits is None:
                done.joining += seqs
                done.cache = batch if done.cache is None else concatenate(done.cache, batch)
            else:
                done.sampled.append((seqs, sample_first(logits, seqs)))
                done.sampled_cache = (
                    batch if done.sampled_cache is None else concatenate(done.sampled_cache, batch)
                )
        return done

    def encode(self, request: Request) -> None:
        """Start a prompt with images before the step's forwards (its input embeddings, the
        vision tower run now): an encoder failure then ends this request alone (the engine
        finishes it and lets go of its prefix hit). From then on the memory its prefill holds
        beyond its cache is its embeddings', not the tower's."""
        if request.request_id not in self._prefill_caches:
            hit = request.prefix_hit
            start = hit.length if hit is not None else 0
            self.vision.start_prefill(request, start, self.model.model.embed_tokens)
            layout = request.layout
            held = [request.embeddings] if request.embeddings is not None else []
            held += [layout.table, *layout.deepstack] if layout is not None else []
            mx.eval(held)
            request.prefill_bytes = sum(array.nbytes for array in held)
            self._prefill_caches[request.request_id] = self._start(request)

    def _start(self, request: Request) -> Cache:
        hit = request.prefix_hit
        if hit is not None and not request.num_preemptions:
            # (A resumed request finds its own state: not what `cached_tokens` reports.)
            request.num_cached_tokens = hit.length
        start = hit.length if hit is not None else 0
        room = request.num_prefill_tokens - start
        cache = start_cache(self.model, self.prefix_cache, hit, room, self.quant)
        request.prefix_hit = None  # (released by start_cache; kept for whoever fails it)
        return cache

    def _prefill_together(self, chunks: list[PrefillChunk]) -> tuple[Cache, mx.array | None]:
        """Prefill the rest of several prompts as one padded batch, each from where its cache
        stands: all their remaining tokens, returning each prompt's last logits (one row per
        prompt), or on a hybrid model all but the last token (logits None; see `_prefill`)."""
        # mlx-lm's PromptProcessingBatch scheme: the caches merged (left padding evens out
        # where they stand), the remaining tokens right-padded to the longest, the padding
        # masked, then rolled to the left where the decode batch expects it.
        cut = 1 if self.hybrid else 0
        requests = [chunk.request for chunk in chunks]
        caches = []
        for request in requests:
            cache = self._prefill_caches.pop(request.request_id, None)
            caches.append(cache if cache is not None else self._start(request))
        ends = [request.num_prefill_tokens - cut for request in requests]
        bodies = [
            chunk.request.prefill_token_ids[chunk.start : end]
            for chunk, end in zip(chunks, ends, strict=True)
        ]
        lengths = [len(body) for body in bodies]
        padding = [max(lengths) - length for length in lengths]
        cache = merge(caches)
        if any(padding):
            for layer in cache:
                layer.prepare(lengths=lengths, right_padding=padding)
        tokens = [[*body, *[0] * pad] for body, pad in zip(bodies, padding, strict=True)]
        last = None
        if self.hybrid:
            self.model(mx.array(tokens), cache=cache)
        else:
            last = self._last_logits(mx.array(tokens), cache, [n - 1 for n in lengths])
        if any(padding):
            for layer in cache:
                layer.finalize()
        for row, (request, end) in enumerate(zip(requests, ends, strict=True)):
            self._remember(request, request.prefill_token_ids[:end], cache, row)
        rows = [i for i, request in enumerate(requests) for _ in request.live_sequences()]
        if len(rows) > len(requests):  # n > 1: every choice gets its own copy of the rows
            for layer in cache:
                layer.filter(rows)
        mx.async_eval([layer.state for layer in cache])
        return cache, last

    def _decode_ahead(self, batches: list[tuple[list[Sequence], SampleResult]]) -> SampleResult:
        position = {id(seq): i for i, seq in enumerate(s for seqs, _ in batches for s in seqs)}
        token_ids = mx.concatenate([result.token_ids for _, result in batches])
        inputs = token_ids[mx.array([position[id(seq)] for seq in self._rows])]
        return decode(self.model, self._rows, self._cache, num_ahead=1, inputs=inputs)

    def _keep_rows(self, keep: list[int]) -> None:
        if len(keep) == len(self._rows):
            return
        if not keep:
            self._rows, self._cache, self._ahead = [], None, None
            return
        self._rows = [self._rows[i] for i in keep]
        for layer in self._cache:
            layer.filter(keep)

    def _extend(self, seqs: list[Sequence], merged: Cache) -> None:
        if self._cache is None:
            self._cache = merged if self.cohort_pad is None else wrap(merged, self.cohort_pad)
        else:
            for layer, new in zip(self._cache, merged, strict=True):
                layer.extend(new)
        self._rows.extend(seqs)
