"""Chat-template rendering: what a caller may pass to the template.

`chat_template_kwargs` exist to set template *variables* (`enable_thinking`, ...). Everything
else `apply_chat_template` accepts is the server's to decide: a caller-supplied `chat_template`
would run the caller's Jinja in the server, `tokenize` or `return_dict` would change what comes
back, `tools`/`documents`/`messages` would bypass validation, and the special-token names would
rewrite what the template writes. Those keys are refused (vLLM closed the same hole as
GHSA-6fvq-23cw-5628).

Rendering runs in a tokenizer process that its deadline kills (engine/text/processes.py).

Tokenizer-only: nothing here touches MLX, so it runs off the engine thread.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Mapping, Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase

from engine.protocol import InvalidRequestError
from engine.text import harmony

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_SPECIAL_TOKEN_NAMES = frozenset(
    {
        "bos_token",
        "eos_token",
        "unk_token",
        "sep_token",
        "pad_token",
        "cls_token",
        "mask_token",
        "additional_special_tokens",
    }
)
# The globals a chat template calls (Jinja's and transformers'): a variable of that name would
# shadow them.
_TEMPLATE_GLOBALS = frozenset(
    {"range", "dict", "lipsum", "cycler", "joiner", "namespace", "raise_exception", "strftime_now"}
)
# The parameters of `apply_chat_template` itself (read from the installed transformers, so an
# upgrade that adds one cannot open a hole), the template's own inputs, the special tokens and
# the template globals. A tokenizer's own extra special-token names are added at render time.
RESERVED_TEMPLATE_KWARGS = (
    frozenset(
        name
        for name, parameter in inspect.signature(
            PreTrainedTokenizerBase.apply_chat_template
        ).parameters.items()
        if parameter.kind is not inspect.Parameter.VAR_KEYWORD and name != "self"
    )
    | {"messages", "conversation", "tools", "documents", "chat_template"}
    | _SPECIAL_TOKEN_NAMES
    | _TEMPLATE_GLOBALS
)

ERROR_RESERVED = (
    "chat_template_kwargs may only set template variables; {key!r} is decided by the server."
)
ERROR_NOT_A_VARIABLE = "chat_template_kwargs keys must be template variable names; got {key!r}."
ERROR_TIMEOUT = "The prompt took longer than {seconds:g} s to render."


def check_template_kwargs(kwargs: Mapping[str, Any], tokenizer: Any = None) -> None:
    """Raise InvalidRequestError (param chat_template_kwargs) for a key that is not a plain
    template variable; given the `tokenizer`, its own special-token names count too."""
    special = set(getattr(tokenizer, "special_tokens_map", None) or ()) if tokenizer else set()
    for key in kwargs:
        if not isinstance(key, str) or not _IDENTIFIER.fullmatch(key):
            raise InvalidRequestError(
                ERROR_NOT_A_VARIABLE.format(key=key), param="chat_template_kwargs"
            )
        if key in RESERVED_TEMPLATE_KWARGS or key in special:
            raise InvalidRequestError(ERROR_RESERVED.format(key=key), param="chat_template_kwargs")


def apply_chat_template(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> list[int]:
    """Token ids of chat messages through the model's template, with tools and template
    variables (checked by `check_template_kwargs`)."""
    variables = dict(chat_template_kwargs or {})
    if not getattr(tokenizer, "has_chat_template", False):
        if harmony.is_harmony_tokenizer(tokenizer):
            check_template_kwargs(variables, tokenizer)
            return harmony.render(
                tokenizer,
                messages,
                tools,
                add_generation_prompt=add_generation_prompt,
                variables=variables,
            )
        raise ValueError("This model has no chat template; send a plain prompt instead.")
    check_template_kwargs(variables, tokenizer)
    text = tokenizer.apply_chat_template(
        [dict(m) for m in messages],
        tools=[dict(tool) for tool in tools] if tools else None,
        add_generation_prompt=add_generation_prompt,
        tokenize=False,
        **variables,
    )
    return list(tokenizer.encode(text, add_special_tokens=False))
