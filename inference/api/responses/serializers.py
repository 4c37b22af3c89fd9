"""The shape of a POST /v1/responses body. Items and tools are read by `items`; ranges and
token ids by the generation service, as on every endpoint. Fields with no meaning here
(`include`, `prompt_cache_key`, `client_metadata`, `safety_identifier`, `stream_options`, ...)
are accepted and ignored; unknown ones too, as OpenAI does."""

from __future__ import annotations

from typing import Any

from rest_framework import serializers

from inference.api.serializers import (
    OPENAI_SERVICE_TIERS,
    CacheSaltField,
    IntField,
    NumberField,
    ServiceTierField,
    StrictBooleanField,
    StrictCharField,
    TemplateKwargsField,
)

METADATA_MAX_KEYS = 16
METADATA_KEY_MAX = 64
METADATA_VALUE_MAX = 512
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")


class ResponseCreateSerializer(serializers.Serializer):
    model = StrictCharField(max_length=200)
    input = serializers.JSONField()
    instructions = StrictCharField(required=False, allow_null=True, allow_blank=True)
    previous_response_id = StrictCharField(required=False, allow_null=True, max_length=64)
    store = StrictBooleanField(required=False, allow_null=True)
    stream = StrictBooleanField(required=False, allow_null=True)
    background = StrictBooleanField(required=False, allow_null=True)
    max_output_tokens = IntField(required=False, allow_null=True)
    temperature = NumberField(required=False, allow_null=True)
    top_p = NumberField(required=False, allow_null=True)
    tools = serializers.JSONField(required=False, allow_null=True)
    tool_choice = serializers.JSONField(required=False, allow_null=True)
    parallel_tool_calls = StrictBooleanField(required=False, allow_null=True)
    max_tool_calls = IntField(required=False, allow_null=True)
    text = serializers.DictField(required=False, allow_null=True)
    reasoning = serializers.DictField(required=False, allow_null=True)
    metadata = serializers.DictField(required=False, allow_null=True)
    user = StrictCharField(required=False, allow_null=True, allow_blank=True)
    truncation = serializers.ChoiceField(
        choices=("auto", "disabled"), required=False, allow_null=True
    )
    conversation = serializers.JSONField(required=False, allow_null=True)
    prompt = serializers.JSONField(required=False, allow_null=True)
    service_tier = ServiceTierField(OPENAI_SERVICE_TIERS)
    # Orchard extensions (the same fields as on chat completions; `extra_body` in the SDKs).
    chat_template_kwargs = TemplateKwargsField()
    structured_outputs = serializers.DictField(required=False, allow_null=True)
    top_k = IntField(required=False, allow_null=True)
    min_p = NumberField(required=False, allow_null=True)
    seed = IntField(required=False, allow_null=True)
    presence_penalty = NumberField(required=False, allow_null=True)
    frequency_penalty = NumberField(required=False, allow_null=True)
    repetition_penalty = NumberField(required=False, allow_null=True)
    cache_salt = CacheSaltField()

    def validate_background(self, value: bool | None) -> bool | None:
        if value:
            raise serializers.ValidationError(
                "Background responses are not supported by this server; stream instead."
            )
        return value

    def validate_conversation(self, value: Any) -> None:
        if value is not None:
            raise serializers.ValidationError(
                "Conversations are not supported by this server; use previous_response_id."
            )

    def validate_prompt(self, value: Any) -> None:
        if value is not None:
            raise serializers.ValidationError("Prompt templates are not supported by this server.")

    def validate_text(self, value: dict | None) -> dict:
        value = value or {}
        fmt = value.get("format") or {"type": "text"}
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind not in ("text", "json_object", "json_schema"):
            raise serializers.ValidationError(
                "text.format.type must be 'text', 'json_object' or 'json_schema'."
            )
        if kind == "json_schema" and not isinstance(fmt.get("schema"), dict):
            raise serializers.ValidationError("text.format json_schema needs a 'schema' object.")
        return {**value, "format": fmt}

    def validate_reasoning(self, value: dict | None) -> dict:
        value = value or {}
        effort = value.get("effort")
        if effort is not None and effort not in REASONING_EFFORTS:
            raise serializers.ValidationError(
                f"reasoning.effort must be one of {', '.join(REASONING_EFFORTS)}."
            )
        return value

    def validate_metadata(self, value: dict | None) -> dict:
        value = value or {}
        if len(value) > METADATA_MAX_KEYS:
            raise serializers.ValidationError(f"metadata takes at most {METADATA_MAX_KEYS} keys.")
        for key, item in value.items():
            if len(key) > METADATA_KEY_MAX or not isinstance(item, str):
                raise serializers.ValidationError(
                    f"metadata keys are strings of at most {METADATA_KEY_MAX} characters and "
                    "values strings."
                )
            if len(item) > METADATA_VALUE_MAX:
                raise serializers.ValidationError(
                    f"metadata values are at most {METADATA_VALUE_MAX} characters."
                )
        return value


class InputItemsQuerySerializer(serializers.Serializer):
    limit = serializers.IntegerField(min_value=1, max_value=100, required=False, default=20)
    order = serializers.ChoiceField(choices=("asc", "desc"), required=False, default="desc")
    after = serializers.CharField(max_length=200, required=False)
