"""How many tokens each engine request of a generation call may make.

A call's prompts are rendered and its sampling decided (inference/services/generation.py); this
turns them into engine requests whose max_tokens `engine.completion_budget` decides, and, for a
flexible call (the caller left max_tokens to the server), sizes them again within the tokens
admission granted.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from engine import (
    GenerationRequest,
    ModelInfo,
    PromptImage,
    RenderedPrompt,
    SamplingParams,
    ServiceClass,
    completion_budget,
)


@dataclass(frozen=True)
class Sizing:
    """The engine requests of a call, their max_tokens decided by `completion_budget`: from the
    caller's max_tokens, else the rest of each prompt's context up to `size_limit`; and, for a
    flexible call (the caller left the size to the server), within what admission granted."""

    request_id: str
    model: str
    prompts: list[RenderedPrompt]
    sampling: SamplingParams
    size_limit: int | None
    info: ModelInfo
    cache_scope: str
    service: ServiceClass
    images: list[tuple[PromptImage, ...]] = dataclasses.field(default_factory=list)

    @property
    def flexible(self) -> bool:
        return self.sampling.max_tokens is None

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(prompt.token_ids) for prompt in self.prompts)

    @property
    def least_tokens(self) -> int:
        """The smallest grant a flexible call can run with: its prompts and a token a choice."""
        return self.num_prompt_tokens + len(self.prompts) * self.sampling.n

    def reserved_tokens(self, requests: list[GenerationRequest]) -> int:
        return self.num_prompt_tokens + sum(r.sampling.max_tokens * r.sampling.n for r in requests)

    def requests(self, *, granted: int | None = None) -> list[GenerationRequest]:
        """With `granted` (admission's grant for the whole call: its prompts and every choice's
        completion), each choice gets an equal share of what the prompts leave, at least one
        token: admission granted `least_tokens`."""
        grant = None
        if granted is not None:
            grant = (granted - self.num_prompt_tokens) // (len(self.prompts) * self.sampling.n)
        requests = []
        for index, rendered in enumerate(self.prompts):
            max_tokens = completion_budget(
                num_prompt_tokens=len(rendered.token_ids),
                context_length=self.info.context_length,
                max_tokens=self.sampling.max_tokens,
                size_limit=self.size_limit,
                grant=grant,
            )
            min_tokens = self.sampling.min_tokens
            if grant is not None:
                min_tokens = min(min_tokens, max_tokens)
            requests.append(
                GenerationRequest(
                    self.request_id if len(self.prompts) == 1 else f"{self.request_id}-{index}",
                    self.model,
                    rendered.token_ids,
                    dataclasses.replace(
                        self.sampling, max_tokens=max_tokens, min_tokens=min_tokens
                    ),
                    rendered.checkpoints,
                    self.cache_scope,
                    service=self.service,
                    images=self.images[index] if self.images else (),
                )
            )
        return requests
