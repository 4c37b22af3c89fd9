"""What the caller hears: a sampled token turned into a `GenerationOutput` (stop checks, text,
logprobs), and the end event of a choice that finishes without one (aborted, failed, refused).

Apart from the loop (engine/core/loop.py), which decides when these happen: this module only
says what each event holds, for both engines alike.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from typing import Any

from engine.core.request import Emit
from engine.core.sampled import Sampled
from engine.protocol import (
    GenerationOutput,
    GenerationRequest,
    RequestStatus,
    TokenLogprob,
    TopLogprob,
)
from engine.text.detokenizer import token_text

logger = logging.getLogger(__name__)


def token_output(
    sampled: Sampled, eos_token_ids: Collection[int], tokenizer: Any
) -> GenerationOutput:
    """Record one sampled token on its sequence (stop checks, text, grammar, status) and return
    the event for the caller."""
    seq, token = sampled.seq, sampled.token_id
    request, params = seq.request, seq.sampling_state.params
    seq.output_token_ids.append(token)
    seq.sampling_state.append(token)
    status = None
    if token in params.stop_token_ids or (token in eos_token_ids and not params.ignore_eos):
        text = ""
        status = RequestStatus.FINISHED_STOPPED
    else:
        text = seq.detokenizer.add(token, match_stop=len(seq.output_token_ids) >= params.min_tokens)
        if seq.constraint is not None:
            seq.constraint.accept(token)
        if seq.detokenizer.stopped or (seq.constraint and seq.constraint.is_complete):
            status = RequestStatus.FINISHED_STOPPED
    if status is None and len(seq.output_token_ids) >= request.max_tokens:
        status = RequestStatus.FINISHED_LENGTH
    if status is not None:
        text += seq.detokenizer.flush()
        seq.status = status
    logprobs = None
    if params.logprobs:
        top = tuple(TopLogprob(token_text(tokenizer, t), t, lp) for t, lp in sampled.top)
        logprobs = (TokenLogprob(token_text(tokenizer, token), token, sampled.logprob, top),)
    return GenerationOutput(
        index=seq.index,
        text=text,
        token_ids=(token,),
        finish_reason=status.finish_reason if status else None,
        logprobs=logprobs,
        num_prompt_tokens=request.num_prompt_tokens,
        num_cached_tokens=request.num_cached_tokens,
        stop_sequence=seq.detokenizer.matched_stop if status else None,
        num_generated_tokens=len(seq.output_token_ids) if status else 0,
    )


def end_queued(
    payload: tuple[GenerationRequest, Emit, int], status: RequestStatus, error: str | None
) -> None:
    """End every choice of a request that was queued but never built."""
    spec, emit, _ = payload
    for index in range(spec.sampling.n):
        emit_end(spec, emit, index, status, error)


def emit_end(
    spec: GenerationRequest,
    emit: Emit,
    index: int,
    status: RequestStatus,
    error: str | None,
    num_generated: int = 0,
) -> None:
    """Tell the caller that choice `index` ended with `status` (never raises)."""
    output = GenerationOutput(
        index=index,
        text="",
        token_ids=(),
        finish_reason=status.finish_reason,
        num_prompt_tokens=len(spec.prompt_token_ids),
        error=error,
        num_generated_tokens=num_generated,
    )
    try:
        emit(output)
    except Exception:
        # The caller's callback failed; the engine must still finish ending everyone else.
        logger.exception("could not deliver the end of request %s", spec.request_id)
