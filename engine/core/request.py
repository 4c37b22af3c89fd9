"""Request and sequence state inside the engine.

One token-accounting model (vLLM v1): a sequence has `num_tokens` (prompt + generated) and
`num_computed_tokens` (tokens whose keys/values are in its cache). Each step the scheduler grants
a sequence some of the difference; a sequence samples a token when it catches up. Prefill and
decode are the same thing at different sizes, and a prefix-cache hit later simply starts
`num_computed_tokens` above zero.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from engine.protocol import GenerationOutput, GenerationRequest, RequestStatus, ServiceClass

Emit = Callable[[GenerationOutput], None]


@dataclass
class Sequence:
    """One choice (`index` in 0..n-1) of a request; its tokens continue the shared prompt."""

    request: Request
    index: int
    sampling_state: Any  # engine.core.sampling.SamplingState
    detokenizer: Any  # engine.text.detokenizer.StreamDetokenizer
    constraint: Any = None  # engine.text.grammar.Constraint under structured output
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING

    @property
    def seq_id(self) -> tuple[str, int]:
        return (self.request.request_id, self.index)

    @property
    def num_tokens(self) -> int:
        return self.request.num_prompt_tokens + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed_tokens < self.request.num_prefill_tokens

    def token_at(self, position: int) -> int:
        prompt = self.request.prompt_token_ids
        if position < len(prompt):
            return prompt[position]
        return self.output_token_ids[position - len(prompt)]


@dataclass(eq=False)
class Request:
    """A `GenerationRequest` admitted to an engine, with its `n` sequences."""

    spec: GenerationRequest
    emit: Emit
    max_tokens: int  # resolved against the context length
    sequences: list[Sequence] = field(default_factory=list)
    arrived_at: float = field(default_factory=time.monotonic)
    # Prompt positions whose recurrent state is worth keeping (hybrid models; else empty).
    checkpoints: tuple[int, ...] = ()
    # Set at admission from the prefix cache (engine.cache.prefix.PrefixHit); the runner seeds
    # the request's cache from it and drops it.
    prefix_hit: Any = None
    num_cached_tokens: int = 0  # prompt tokens the prefix cache provided
    # A preempted request (engine/core/scheduler.py) resumes by prefilling its prompt and the
    # tokens it had generated (`resumed_token_ids`, of its one sequence): that computes its
    # cache again, or finds it in the prefix cache, where preemption left it.
    resumed_token_ids: tuple[int, ...] = ()
    num_preemptions: int = 0
    # A prompt with images (engine/models/vision.py): its ids with each image's placeholder
    # tokens keyed by the image (`cache_key_ids`), which the prefix cache and the runner see as
    # `prompt_token_ids`; and, while it prefills, its input embeddings (the images' features
    # at their placeholders), which its prefill chunks are fed instead of ids.
    image_key_ids: tuple[int, ...] | None = None
    embeddings: Any = None
    # On an M-RoPE model (engine/models/mrope.py), a prompt with images' layout while it
    # prefills (a `Layout` of its `prefill_token_ids`), and the shift of each later token's
    # position from its index, which its decode steps add (0: plain positions).
    layout: Any = None
    rope_delta: int = 0
    # Memory its prefill holds beyond its cache (an image request's vision tower forward),
    # which the memory budget counts while it prefills.
    prefill_bytes: int = 0

    @property
    def request_id(self) -> str:
        return self.spec.request_id

    @property
    def prompt_token_ids(self) -> tuple[int, ...]:
        """The prompt as the engine keys it: its token ids, with image positions keyed by
        their image (`image_key_ids`; those positions are fed embeddings, never their ids)."""
        if self.image_key_ids is not None:
            return self.image_key_ids
        return self.spec.prompt_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.spec.prompt_token_ids)

    @property
    def prefill_token_ids(self) -> tuple[int, ...]:
        """What its cache must hold before it decodes: the prompt (and, resumed after a
        preemption, the tokens it had generated)."""
        if self.resumed_token_ids:
            return self.prompt_token_ids + self.resumed_token_ids
        return self.prompt_token_ids

    @property
    def num_prefill_tokens(self) -> int:
        return len(self.spec.prompt_token_ids) + len(self.resumed_token_ids)

    @property
    def service(self) -> ServiceClass:
        return self.spec.service

    @property
    def can_resume(self) -> bool:
        """Whether it can be preempted and resumed: one sequence, or none of its sequences
        has generated anything yet (they all resume from the prompt)."""
        return len(self.sequences) == 1 or not any(seq.output_token_ids for seq in self.sequences)

    @property
    def cache_scope(self) -> str:
        return self.spec.cache_scope

    @property
    def status(self) -> RequestStatus:
        """The least advanced status of its sequences: finished only when all are."""
        return min(seq.status for seq in self.sequences)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def live_sequences(self) -> list[Sequence]:
        return [seq for seq in self.sequences if not seq.status.is_finished]
