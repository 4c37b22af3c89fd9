"""The one check of a generation request against the model that will run it, and the one
sizing of its completion."""

from __future__ import annotations

from dataclasses import dataclass

from engine.protocol.errors import InvalidRequestError
from engine.protocol.generation import GenerationRequest
from engine.protocol.models import ModelInfo


@dataclass(frozen=True)
class PromptRoom:
    """What a prompt must leave room for: `completion` tokens (the request's max_tokens, else 1)
    within the model's `context_length`. Checked by `validate_generation`, and where the prompt
    is tokenized (engine/text/rendering.py), so that a prompt too long for the model is refused
    there and its token ids never cross back to the web process (250,000 ids are some 15 ms of
    the interpreter lock to unpickle and free)."""

    context_length: int
    completion: int
    param: str = "prompt"

    def check(self, num_prompt: int) -> None:
        if num_prompt + self.completion > self.context_length:
            raise InvalidRequestError(
                f"This model's maximum context length is {self.context_length} tokens. However, "
                f"you requested {num_prompt + self.completion} tokens ({num_prompt} in the "
                f"{self.param}, {self.completion} in the completion). Please reduce the length of "
                f"the {self.param} or completion.",
                param=self.param,
                code="context_length_exceeded",
            )


def validate_generation(
    request: GenerationRequest, info: ModelInfo, *, prompt_param: str = "prompt"
) -> None:
    """The one check of a request against the model that will run it: sampling ranges, every
    token id inside the vocabulary, the prompt and its completion inside the context, and n
    within what the engine can run. Raises InvalidRequestError naming the offending parameter
    (`prompt_param` for the prompt: "messages" on chat, "prompt" on completions).

    The API calls it at the edge; the engine calls it again when a request is submitted,
    because a bad id reaching the device corrupts other requests' memory."""
    params = request.sampling
    params.validate(vocab_size=info.vocab_size)
    if params.n > info.max_choices:
        raise InvalidRequestError(
            f"This model serves at most {info.max_choices} choices per request (n={params.n}).",
            param="n",
        )
    if request.images and "image" not in info.input_kinds:
        raise InvalidRequestError(
            f"The model {info.name} takes no images: send text only, or use a vision model.",
            param=prompt_param,
        )
    ids = request.prompt_token_ids
    num_prompt = len(ids)
    if num_prompt == 0:
        raise InvalidRequestError(f"The {prompt_param} is empty.", param=prompt_param)
    completion = params.max_tokens or 1
    needed = params.n * (num_prompt + completion)
    PromptRoom(info.context_length, completion, prompt_param).check(num_prompt)
    if info.max_request_tokens is not None and needed > info.max_request_tokens:
        raise InvalidRequestError(
            f"This request needs room for {needed} tokens ({params.n} × ({num_prompt} + "
            f"{completion})) in the model's memory, which holds {info.max_request_tokens}. "
            "Lower max_tokens or n, or shorten the prompt.",
            param="max_tokens",
        )
    # Last, once the prompt is known to fit (its length bounds this scan), and in C: this runs
    # on the event loop.
    if min(ids) < 0 or max(ids) >= info.vocab_size:
        raise InvalidRequestError(
            f"The {prompt_param} has token ids outside the vocabulary.", param=prompt_param
        )


def completion_budget(
    *,
    num_prompt_tokens: int,
    context_length: int,
    max_tokens: int | None = None,
    size_limit: int | None = None,
    grant: int | None = None,
) -> int:
    """How many tokens each choice of a request may generate, decided here only: the caller's
    `max_tokens` as given (`validate_generation` refuses one that does not fit, rather than
    cutting it); else the rest of the context, at most `size_limit` (the model's or the
    endpoint's default size); then at most `grant`, the completion tokens admission granted
    each choice of a request the caller left to the server to size. A prompt that leaves no room
    is sized to 1, so that validation reports it (context_length_exceeded)."""
    if max_tokens is None:
        room = max(context_length - num_prompt_tokens, 1)
        max_tokens = room if size_limit is None else min(room, size_limit)
    return max_tokens if grant is None else min(max_tokens, grant)
