"""Input serializers for the /v1 endpoints: the *shape* of a body (JSON types, which forms a
field takes). Ranges and token ids are checked once, by `engine.protocol.validate_generation`,
after the model's defaults are applied. Unknown fields are ignored, as OpenAI does."""

import math
import re
from collections.abc import Mapping
from typing import Any

from rest_framework import serializers
from rest_framework.fields import empty

from engine import InvalidRequestError, check_template_kwargs
from inference.api import jsonbody
from inference.services.service_class import AUTO_TIERS

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_CACHE_SALT_CHARS = 256
_TOKEN_ID_KEY = re.compile(r"-?[0-9]{1,12}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class StrictCharField(serializers.CharField):
    """JSON strings only: OpenAI rejects `"model": 5` rather than reading it as "5". Kept as
    sent (a stop sequence or instructions may begin or end with a space)."""

    def __init__(self, **kwargs):
        kwargs.setdefault("trim_whitespace", False)
        super().__init__(**kwargs)

    def to_internal_value(self, data: Any) -> str:
        if not isinstance(data, str):
            self.fail("invalid")
        return super().to_internal_value(data)


class StrictBooleanField(serializers.BooleanField):
    """JSON booleans only: OpenAI rejects "yes" for a boolean."""

    def to_internal_value(self, data: Any) -> bool:
        if isinstance(data, bool):
            return data
        self.fail("invalid", input=data)


class CacheSaltField(StrictCharField):
    """`cache_salt` (as in vLLM): a non-empty string of at most MAX_CACHE_SALT_CHARS that narrows
    the prefix cache a request may reuse to requests with the same salt (and team); null or
    absent: none."""

    default_error_messages = {
        "invalid": "cache_salt must be a string.",
        "blank": "cache_salt must not be empty.",
        "max_length": f"cache_salt takes at most {MAX_CACHE_SALT_CHARS} characters.",
    }

    def __init__(self, **kwargs):
        super().__init__(required=False, allow_null=True, max_length=MAX_CACHE_SALT_CHARS, **kwargs)


# `service_tier` values and the tiers each accepts, most wanted first
# (inference/services/service_class.py). OpenAI's: "auto" is default, else what the key has;
# "scale" (OpenAI's reserved capacity) is refused.
OPENAI_SERVICE_TIERS = {
    "auto": AUTO_TIERS,
    "default": ("default",),
    "flex": ("flex",),
    "priority": ("priority",),
}
# Anthropic's: "auto" (its default) is priority capacity when there is some, "standard_only"
# never asks for it.
ANTHROPIC_SERVICE_TIERS = {"auto": ("priority", "default", "flex"), "standard_only": AUTO_TIERS}


class ServiceTierField(serializers.Field):
    """`service_tier`: one of the API's values (`tiers`), read as the tiers it accepts; absent
    or null is "auto"."""

    default_error_messages = {"invalid": "service_tier must be one of {choices}."}

    def __init__(self, tiers: Mapping[str, tuple[str, ...]], **kwargs):
        self.tiers = tiers
        super().__init__(required=False, allow_null=True, **kwargs)

    def validate_empty_values(self, data: Any) -> tuple[bool, Any]:
        if data is empty or data is None:
            return True, self.tiers["auto"]
        return super().validate_empty_values(data)

    def to_internal_value(self, data: Any) -> tuple[str, ...]:
        if not isinstance(data, str) or data not in self.tiers:
            self.fail("invalid", choices=", ".join(f"'{name}'" for name in self.tiers))
        return self.tiers[data]

    def to_representation(self, value: Any) -> Any:
        return value


class NumberField(serializers.Field):
    """A JSON number (not a boolean, not a string), finite."""

    default_error_messages = {"invalid": "A number is required."}

    def to_internal_value(self, data: Any) -> float:
        if isinstance(data, bool) or not isinstance(data, int | float):
            self.fail("invalid")
        try:
            value = float(data)
        except OverflowError:  # an integer too large for a float
            self.fail("invalid")
        if not math.isfinite(value):
            self.fail("invalid")
        return value

    def to_representation(self, value: Any) -> Any:
        return value


class IntField(serializers.Field):
    """A JSON integer (an integral number such as 2.0 is taken as 2; booleans are not)."""

    default_error_messages = {"invalid": "An integer is required."}

    def to_internal_value(self, data: Any) -> int:
        if _is_int(data):
            return data
        if isinstance(data, float) and math.isfinite(data) and data.is_integer():
            return int(data)
        self.fail("invalid")

    def to_representation(self, value: Any) -> Any:
        return value


class TemplateKwargsField(serializers.DictField):
    """`chat_template_kwargs`: template variables only
    (engine.text.templates.check_template_kwargs); null or absent is {}."""

    def __init__(self, **kwargs):
        super().__init__(required=False, allow_null=True, **kwargs)

    def to_internal_value(self, data: Any) -> dict:
        value = super().to_internal_value(data)
        try:
            check_template_kwargs(value)
        except InvalidRequestError as exc:
            raise serializers.ValidationError(str(exc)) from None
        return value


class StopField(serializers.Field):
    default_error_messages = {"invalid": "stop must be a string or a list of strings."}

    def to_internal_value(self, data: Any) -> tuple[str, ...]:
        if isinstance(data, str):
            return (data,)
        if isinstance(data, list) and all(isinstance(s, str) for s in data):
            return tuple(data)
        self.fail("invalid")

    def to_representation(self, value: Any) -> Any:
        return value


class SamplingSerializer(serializers.Serializer):
    """Fields shared by chat completions and completions."""

    model = StrictCharField(max_length=200)
    temperature = NumberField(required=False, allow_null=True)
    top_p = NumberField(required=False, allow_null=True)
    top_k = IntField(required=False, allow_null=True)
    min_p = NumberField(required=False, allow_null=True)
    presence_penalty = NumberField(required=False, allow_null=True)
    frequency_penalty = NumberField(required=False, allow_null=True)
    repetition_penalty = NumberField(required=False, allow_null=True)
    logit_bias = serializers.DictField(child=NumberField(), required=False, allow_null=True)
    seed = IntField(required=False, allow_null=True)
    n = IntField(required=False, allow_null=True)
    stop = StopField(required=False, allow_null=True)
    stop_token_ids = serializers.ListField(child=IntField(), required=False, allow_null=True)
    max_tokens = IntField(required=False, allow_null=True)
    min_tokens = IntField(required=False, allow_null=True)
    ignore_eos = StrictBooleanField(required=False, allow_null=True)
    stream = StrictBooleanField(required=False, allow_null=True)
    stream_options = serializers.DictField(required=False, allow_null=True)
    user = StrictCharField(required=False, allow_null=True, allow_blank=True)
    cache_salt = CacheSaltField()
    service_tier = ServiceTierField(OPENAI_SERVICE_TIERS)

    def validate_logit_bias(self, value: dict | None) -> dict[int, float]:
        biases = {}
        for key, bias in (value or {}).items():
            if not _TOKEN_ID_KEY.fullmatch(key):
                raise serializers.ValidationError("logit_bias keys must be token ids.")
            biases[int(key)] = bias
        return biases

    def validate_stream_options(self, value: dict | None) -> dict:
        value = value or {}
        if not isinstance(value.get("include_usage", False), bool):
            raise serializers.ValidationError("include_usage must be a boolean.")
        return value


class ChatCompletionSerializer(SamplingSerializer):
    messages = serializers.ListField(child=serializers.JSONField(), allow_empty=False)
    max_completion_tokens = IntField(required=False, allow_null=True)
    logprobs = StrictBooleanField(required=False, allow_null=True)
    top_logprobs = IntField(required=False, allow_null=True)
    response_format = serializers.DictField(required=False, allow_null=True)
    tools = serializers.ListField(child=serializers.DictField(), required=False, allow_null=True)
    tool_choice = serializers.JSONField(required=False, allow_null=True)
    parallel_tool_calls = StrictBooleanField(required=False, allow_null=True)
    chat_template_kwargs = TemplateKwargsField()

    structured_outputs = serializers.DictField(required=False, allow_null=True)

    def validate_response_format(self, value: dict | None) -> dict | None:
        if value is None:
            return None
        kind = value.get("type")
        if kind not in ("text", "json_object", "json_schema"):
            raise serializers.ValidationError(
                "response_format.type must be 'text', 'json_object' or 'json_schema'."
            )
        if kind == "json_schema" and not isinstance(value.get("json_schema"), dict):
            raise serializers.ValidationError(
                "response_format json_schema needs a 'json_schema' object with the 'schema'."
            )
        return value

    def validate_tools(self, value: list | None) -> list | None:
        for index, tool in enumerate(value or []):
            function = tool.get("function")
            if tool.get("type") != "function" or not isinstance(function, dict):
                raise serializers.ValidationError(f"tools[{index}] must be a function tool.")
            if not isinstance(function.get("name"), str) or not function["name"]:
                raise serializers.ValidationError(f"tools[{index}].function.name is required.")
            if not isinstance(function.get("parameters", {}), dict):
                raise serializers.ValidationError(
                    f"tools[{index}].function.parameters must be a JSON Schema object."
                )
        return value

    def validate_tool_choice(self, value: Any) -> Any:
        if value is None or value in ("auto", "none", "required"):
            return value
        function = value.get("function") if isinstance(value, dict) else None
        if (
            not isinstance(value, dict)
            or value.get("type") != "function"
            or not isinstance(function, dict)
            or not isinstance(function.get("name"), str)
        ):
            raise serializers.ValidationError(
                "tool_choice must be 'auto', 'none', 'required' or "
                '{"type": "function", "function": {"name": ...}}.'
            )
        return value


class CompletionSerializer(SamplingSerializer):
    prompt = serializers.JSONField()
    echo = StrictBooleanField(required=False, allow_null=True)
    logprobs = IntField(required=False, allow_null=True)
    suffix = StrictCharField(required=False, allow_null=True, allow_blank=True)
    best_of = IntField(required=False, allow_null=True)
    structured_outputs = serializers.DictField(required=False, allow_null=True)

    def validate_logprobs(self, value: int | None) -> int | None:
        # The legacy endpoint's own limit (chat allows top_logprobs up to 20).
        if value is not None and not 0 <= value <= 5:
            raise serializers.ValidationError("logprobs must be between 0 and 5.")
        return value

    def validate_prompt(self, value: Any) -> list[str | list[int]]:
        """A string, a list of strings, a list of token ids, or a list of lists of token ids."""
        if isinstance(value, str):
            return [value]
        if isinstance(value, list) and value:
            if all(isinstance(p, str) for p in value):
                return list(value)
            if all(_is_int(t) for t in value):
                return [list(value)]
            if all(isinstance(p, list) and p and all(_is_int(t) for t in p) for p in value):
                return [list(p) for p in value]
        raise serializers.ValidationError(
            "prompt must be a string, a list of strings, or token ids (a list of integers or a "
            "list of such lists), and not empty."
        )


class MessageError(ValueError):
    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.message = message
        self.param = param


def normalize_messages(messages: list[Any]) -> list[dict[str, Any]]:
    return [normalize_message(message, index) for index, message in enumerate(messages)]


def normalize_message(message: Any, index: int) -> dict[str, Any]:
    """An OpenAI chat message as the chat template expects it: text content as one string,
    `developer` as `system`, tool-call arguments as objects, an assistant's reasoning as
    `reasoning_content`."""
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise MessageError(f"{where} must be an object.", where)
    role = message.get("role")
    if role not in ROLES:
        raise MessageError(
            f"{where}.role must be one of {', '.join(ROLES)}; got {role!r}.", f"{where}.role"
        )
    content = _content(message.get("content"), where, images=role == "user")
    normalized: dict[str, Any] = {"role": "system" if role == "developer" else role}
    tool_calls = message.get("tool_calls")
    if role == "assistant" and tool_calls:
        normalized["tool_calls"] = _tool_calls(tool_calls, where)
    elif content is None:
        raise MessageError(f"{where}.content is required.", f"{where}.content")
    normalized["content"] = content if content is not None else ""
    if role == "tool":
        if not isinstance(message.get("tool_call_id"), str):
            raise MessageError(f"{where}.tool_call_id is required.", f"{where}.tool_call_id")
        normalized["tool_call_id"] = message["tool_call_id"]
    if isinstance(message.get("name"), str):
        normalized["name"] = message["name"]
    # An earlier reply's reasoning, sent back: templates that keep reasoning in the history
    # (Qwen3, gpt-oss) render it.
    reasoning = message.get("reasoning_content", message.get("reasoning"))
    if role == "assistant" and isinstance(reasoning, str) and reasoning:
        normalized["reasoning_content"] = reasoning
    return normalized


IMAGE_DETAILS = ("auto", "low", "high")


def _content(content: Any, where: str, *, images: bool) -> str | list[dict[str, Any]] | None:
    """Text parts as one string; with image parts (user messages only), the parts in order:
    text as {"type": "text", "text"}, images as {"type": "image", "url", "param"} (the
    generation service fetches and checks them: inference/services/images.py)."""
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise MessageError(
            f"{where}.content must be a string or a list of parts.", f"{where}.content"
        )
    parts: list[dict[str, Any]] = []
    for index, part in enumerate(content):
        at = f"{where}.content[{index}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "image_url" and images:
            parts.append(_image_part(part.get("image_url"), at))
        else:
            allowed = "text and image_url" if images else "text"
            raise MessageError(
                f"{at}: only {allowed} content parts are supported here; got type {kind!r}.",
                f"{at}.type",
            )
    if not any(part["type"] == "image" for part in parts):
        return "".join(part["text"] for part in parts)
    return parts


def _image_part(image_url: Any, at: str) -> dict[str, Any]:
    if isinstance(image_url, str):  # some clients send the URL itself
        image_url = {"url": image_url}
    url = image_url.get("url") if isinstance(image_url, dict) else None
    if not isinstance(url, str) or not url:
        raise MessageError(
            f"{at}.image_url.url must be a URL or a data URL.", f"{at}.image_url.url"
        )
    detail = image_url.get("detail", "auto")
    if detail not in IMAGE_DETAILS:
        raise MessageError(
            f"{at}.image_url.detail must be one of {', '.join(IMAGE_DETAILS)}.",
            f"{at}.image_url.detail",
        )
    return {"type": "image", "url": url, "param": f"{at}.image_url.url", "detail": detail}


def _tool_calls(tool_calls: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(tool_calls, list):
        raise MessageError(f"{where}.tool_calls must be a list.", f"{where}.tool_calls")
    calls = []
    for index, call in enumerate(tool_calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise MessageError(
                f"{where}.tool_calls[{index}] needs function.name.", f"{where}.tool_calls"
            )
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            # Templates (Qwen, Llama) render arguments with `tojson`; give them the object.
            try:
                arguments = jsonbody.loads(arguments or "{}")
            except jsonbody.BodyError:
                pass
        calls.append(
            {
                "id": call.get("id"),
                "type": "function",
                "function": {"name": function["name"], "arguments": arguments},
            }
        )
    return calls
