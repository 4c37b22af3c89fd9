"""Anthropic Messages requests → what the chat template renders.

`system` becomes the system message; a user turn's `tool_result` blocks become tool messages
(before the turn's text); an assistant turn's `thinking` blocks its `reasoning_content` and its
`tool_use` blocks its tool calls. `tools` are client tools (`input_schema` is the function's
parameters); Anthropic's server tools (web search, code execution, bash / text editor / computer
use, ...) run on Anthropic's side and are left out. `tool_choice` maps to chat's: `auto`, `any`
(= required), `tool` (a named function), `none`; `disable_parallel_tool_use` to
`parallel_tool_calls: false`. `thinking` maps to the template's `enable_thinking`.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from inference.api.serializers import MessageError, normalize_messages
from inference.errors import APIError

ROLES = ("user", "assistant")


def _fail(message: str, param: str) -> APIError:
    return APIError(400, f"{param}: {message}", param=param)


def _blocks(content: Any, where: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise _fail("content must be a string or a list of content blocks.", where)
    for index, block in enumerate(content):
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise _fail("each content block is an object with a type.", f"{where}.{index}")
    return content


def _text_of(content: Any, where: str) -> str:
    """Text blocks (or a string) joined; other blocks are refused by name."""
    texts = []
    for index, block in enumerate(_blocks(content, where)):
        if block["type"] != "text" or not isinstance(block.get("text"), str):
            raise _fail(
                f"only text blocks are supported here by this server; got {block['type']!r}.",
                f"{where}.{index}.type",
            )
        texts.append(block["text"])
    return "\n\n".join(texts)


def system_text(system: Any) -> str | None:
    if system is None:
        return None
    return _text_of(system, "system")


def chat_messages(system: Any, messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise _fail("at least one message is required.", "messages")
    out: list[dict[str, Any]] = []
    text = system_text(system)
    if text:
        out.append({"role": "system", "content": text})
    for index, message in enumerate(messages):
        where = f"messages.{index}"
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise _fail("each message is an object with role 'user' or 'assistant'.", where)
        blocks = _blocks(message.get("content"), f"{where}.content")
        if message["role"] == "user":
            out += _user_turn(blocks, f"{where}.content")
        else:
            out.append(_assistant_turn(blocks, f"{where}.content"))
    try:
        return normalize_messages(out)
    except MessageError as exc:  # not expected: built above
        raise APIError(400, exc.message, param="messages") from None


def _image_url(block: dict[str, Any], where: str) -> str:
    """An image block's source as a URL (base64 data as a data URL), for the chat messages'
    `image_url` part; the generation service checks the image itself."""
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64":
        media_type, data = source.get("media_type"), source.get("data")
        if not isinstance(media_type, str) or not isinstance(data, str) or not data:
            raise _fail("a base64 image source needs media_type and data.", f"{where}.source")
        return f"data:{media_type};base64,{data}"
    if kind == "url" and isinstance(source.get("url"), str) and source["url"]:
        return source["url"]
    raise _fail(
        "an image's source is {type: base64, media_type, data} or {type: url, url}.",
        f"{where}.source",
    )


def _user_turn(blocks: list[dict[str, Any]], where: str) -> list[dict[str, Any]]:
    out, texts = [], []
    parts: list[dict[str, Any]] = []  # text and images in order, when the turn has images
    for index, block in enumerate(blocks):
        kind = block["type"]
        if kind == "tool_result":
            tool_use_id = block.get("tool_use_id")
            if not isinstance(tool_use_id, str) or not tool_use_id:
                raise _fail("tool_result needs tool_use_id.", f"{where}.{index}.tool_use_id")
            result = _text_of(block.get("content", ""), f"{where}.{index}.content")
            if block.get("is_error"):
                result = f"Error: {result}"
            out.append({"role": "tool", "tool_call_id": tool_use_id, "content": result})
        elif kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "image":
            url = _image_url(block, f"{where}.{index}")
            parts.append({"type": "image_url", "image_url": {"url": url}})
        else:
            raise _fail(
                "only text, image and tool_result blocks are supported in user turns; "
                f"got {kind!r}.",
                f"{where}.{index}.type",
            )
    if any(part["type"] == "image_url" for part in parts):
        out.append({"role": "user", "content": parts})
    elif texts or not out:
        out.append({"role": "user", "content": "\n\n".join(texts)})
    return out


def _assistant_turn(blocks: list[dict[str, Any]], where: str) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": ""}
    texts, reasoning, calls = [], [], []
    for index, block in enumerate(blocks):
        kind = block["type"]
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "thinking" and isinstance(block.get("thinking"), str):
            reasoning.append(block["thinking"])
        elif kind == "redacted_thinking":
            continue  # encrypted by Anthropic: nothing a local model can read
        elif kind == "tool_use":
            name, call_id = block.get("name"), block.get("id")
            if not isinstance(name, str) or not name or not isinstance(call_id, str):
                raise _fail("tool_use needs id and name.", f"{where}.{index}")
            arguments = block.get("input", {})
            if not isinstance(arguments, dict):
                raise _fail("tool_use input must be an object.", f"{where}.{index}.input")
            calls.append(
                {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": name, "arguments": json.dumps(arguments)},
                }
            )
        else:
            raise _fail(
                f"{kind!r} blocks are not supported in assistant turns by this server.",
                f"{where}.{index}.type",
            )
    message["content"] = "".join(texts)
    if reasoning:
        message["reasoning_content"] = "\n\n".join(reasoning)
    if calls:
        message["tool_calls"] = calls
    return message


def chat_tools(tools: Any) -> list[dict[str, Any]]:
    """Client tools in chat shape (server tools are left out)."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise _fail("tools must be a list.", "tools")
    out = []
    for index, tool in enumerate(tools):
        where = f"tools.{index}"
        if not isinstance(tool, dict):
            raise _fail("each tool is an object.", where)
        if tool.get("type") not in (None, "custom"):
            continue  # a server tool (web_search_..., bash_..., text_editor_..., ...)
        name = tool.get("name")
        if not isinstance(name, str) or not name or len(name) > 200:
            raise _fail("a tool needs a name.", f"{where}.name")
        schema = tool.get("input_schema")
        if not isinstance(schema, dict):
            raise _fail("a tool needs an input_schema object.", f"{where}.input_schema")
        function = {"name": name, "parameters": schema}
        if isinstance(tool.get("description"), str):
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: Any) -> tuple[Any, bool]:
    """(chat tool_choice, parallel_tool_calls) for Anthropic's tool_choice."""
    if choice is None:
        return None, True
    kind = choice.get("type") if isinstance(choice, dict) else None
    parallel = not (isinstance(choice, dict) and choice.get("disable_parallel_tool_use") is True)
    if kind == "auto":
        return "auto", parallel
    if kind == "any":
        return "required", parallel
    if kind == "none":
        return "none", parallel
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise _fail(
        'tool_choice must be {"type": "auto" | "any" | "none"} or {"type": "tool", "name": ...}.',
        "tool_choice",
    )


def template_kwargs(thinking: Any) -> dict[str, Any]:
    if thinking is None:
        return {}
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if kind in ("enabled", "adaptive"):
        return {"enable_thinking": True}
    if kind == "disabled":
        return {"enable_thinking": False}
    raise _fail("thinking.type must be 'enabled', 'adaptive' or 'disabled'.", "thinking")


def tool_use_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"
