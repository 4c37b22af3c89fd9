"""Responses API input → what the chat template renders.

`input_items` reads the request's `input` into items of one canonical shape, each with an id
(the client's, or a new one): what is stored and what `input_items` lists. `chat_messages`
turns a conversation of such items into chat messages (a function call is an assistant tool
call, its output a tool message, a reasoning item the next assistant turn's
`reasoning_content`). `template_tools` picks the function tools the template sees: function
tools, and those grouped in a `namespace` (named `namespace.name` for the model); hosted tools
(web search, file search, code interpreter, ...) are tools this server cannot run and are left
out.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from inference.api.serializers import MessageError, normalize_messages
from inference.errors import APIError

MESSAGE_ROLES = ("user", "assistant", "system", "developer")
TEXT_PART_TYPES = ("input_text", "output_text", "text", "summary_text", "reasoning_text")
CALL_TYPES = ("function_call", "custom_tool_call")
CALL_OUTPUT_TYPES = ("function_call_output", "custom_tool_call_output")
ITEM_ID_PREFIXES = {
    "message": "msg",
    "function_call": "fc",
    "custom_tool_call": "ctc",
    "function_call_output": "fco",
    "custom_tool_call_output": "ctco",
    "reasoning": "rs",
}
# Tools of these types run on OpenAI's side (or are the client's own, freeform): no model here
# is given them, and a request that carries them is answered without them.
LEFT_OUT_TOOL_TYPES = (
    "web_search",
    "web_search_preview",
    "web_search_preview_2025_03_11",
    "web_search_2025_08_26",
    "file_search",
    "computer",
    "computer_use_preview",
    "code_interpreter",
    "image_generation",
    "mcp",
    "local_shell",
    "shell",
    "apply_patch",
    "custom",
    "tool_search",
)


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _fail(message: str, param: str) -> APIError:
    return APIError(400, message, param=param)


def _text(value: Any, where: str) -> str:
    """A string, or a list of text parts joined (any other part is refused by name)."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise _fail(f"{where} must be a string or a list of content parts.", where)
    texts = []
    for index, part in enumerate(value):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PART_TYPES or not isinstance(part.get("text"), str):
            raise _fail(
                f"{where}[{index}]: only text content parts are supported by this server; "
                f"got type {kind!r}.",
                f"{where}[{index}].type",
            )
        texts.append(part["text"])
    return "\n\n".join(texts)


def _string(item: dict, key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value:
        raise _fail(f"{where}.{key} is required (a string).", f"{where}.{key}")
    return value


def _item_id(item: dict, kind: str) -> str:
    given = item.get("id")
    if isinstance(given, str) and given and len(given) <= 200:
        return given
    return new_id(ITEM_ID_PREFIXES[kind])


def input_items(value: Any, param: str = "input") -> list[dict[str, Any]]:
    """The request's `input` (a string, or a list of items) as canonical items."""
    if isinstance(value, str):
        value = [{"type": "message", "role": "user", "content": value}]
    if not isinstance(value, list):
        raise _fail(f"'{param}' must be a string or a list of input items.", param)
    return [_input_item(item, f"{param}[{index}]") for index, item in enumerate(value)]


def _input_item(item: Any, where: str) -> dict[str, Any]:
    if not isinstance(item, dict):
        raise _fail(f"{where} must be an object.", where)
    kind = item.get("type", "message" if "role" in item else None)
    if kind == "message":
        role = item.get("role")
        if role not in MESSAGE_ROLES:
            raise _fail(
                f"{where}.role must be one of {', '.join(MESSAGE_ROLES)}; got {role!r}.",
                f"{where}.role",
            )
        part_type = "output_text" if role == "assistant" else "input_text"
        content = item.get("content")
        if role == "user" and _has_images(content):
            parts = _user_parts(content, f"{where}.content")
        else:
            part: dict[str, Any] = {"type": part_type, "text": _text(content, f"{where}.content")}
            if role == "assistant":
                part["annotations"] = []
            parts = [part]
        return {
            "id": _item_id(item, kind),
            "type": "message",
            "role": role,
            "status": "completed",
            "content": parts,
        }
    if kind in CALL_TYPES:
        canonical = {
            "id": _item_id(item, kind),
            "type": kind,
            "call_id": _string(item, "call_id", where),
            "name": _string(item, "name", where),
            "status": "completed",
        }
        if kind == "function_call":
            arguments = item.get("arguments", "")
            if isinstance(arguments, dict):  # lenient: an object for the JSON string
                arguments = json.dumps(arguments)
            if not isinstance(arguments, str):
                raise _fail(f"{where}.arguments must be a string.", f"{where}.arguments")
            canonical["arguments"] = arguments
        else:
            canonical["input"] = _text(item.get("input", ""), f"{where}.input")
        if isinstance(item.get("namespace"), str) and item["namespace"]:
            canonical["namespace"] = item["namespace"]
        return canonical
    if kind in CALL_OUTPUT_TYPES:
        return {
            "id": _item_id(item, kind),
            "type": kind,
            "call_id": _string(item, "call_id", where),
            "output": _text(item.get("output", ""), f"{where}.output"),
            "status": "completed",
        }
    if kind == "reasoning":
        summary = item.get("summary") or []
        content = item.get("content") or []
        canonical = {
            "id": _item_id(item, kind),
            "type": "reasoning",
            "summary": [{"type": "summary_text", "text": _text(summary, f"{where}.summary")}]
            if summary
            else [],
        }
        if content:
            canonical["content"] = [
                {"type": "reasoning_text", "text": _text(content, f"{where}.content")}
            ]
        return canonical
    if kind == "item_reference":
        raise _fail(
            "Item references are not supported by this server: send the item itself, or "
            "continue a stored response with previous_response_id.",
            f"{where}.type",
        )
    raise _fail(f"{where}.type {kind!r} is not an input item this server reads.", f"{where}.type")


def _reasoning_text(item: dict[str, Any]) -> str:
    parts = item.get("content") or item.get("summary") or []
    return "\n\n".join(part.get("text", "") for part in parts if isinstance(part, dict))


def _has_images(content: Any) -> bool:
    return isinstance(content, list) and any(
        isinstance(part, dict) and part.get("type") == "input_image" for part in content
    )


def _user_parts(content: list, where: str) -> list[dict[str, Any]]:
    """A user message's text and `input_image` parts, in order (an image by its URL or data
    URL; the generation service reads and checks it)."""
    parts = []
    for index, part in enumerate(content):
        at = f"{where}[{index}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "input_image":
            url = part.get("image_url")
            if not isinstance(url, str) or not url:
                raise _fail(
                    f"{at}.image_url must be a URL or a data URL (file_id is not supported).",
                    f"{at}.image_url",
                )
            parts.append(
                {"type": "input_image", "image_url": url, "detail": part.get("detail", "auto")}
            )
        elif kind in TEXT_PART_TYPES and isinstance(part.get("text"), str):
            parts.append({"type": "input_text", "text": part["text"]})
        else:
            raise _fail(
                f"{at}: only text and input_image content parts are supported here; got "
                f"type {kind!r}.",
                f"{at}.type",
            )
    return parts


def _user_content(item: dict[str, Any]) -> str | list[dict[str, Any]]:
    """A user message item's content for the chat messages: its text, or with images, its
    parts as chat's (`image_url` parts)."""
    parts = item.get("content") or ()
    if not any(part.get("type") == "input_image" for part in parts):
        return _message_text(item)
    return [
        {"type": "image_url", "image_url": {"url": part["image_url"], "detail": part["detail"]}}
        if part.get("type") == "input_image"
        else {"type": "text", "text": part.get("text", "")}
        for part in parts
    ]


def _message_text(item: dict[str, Any]) -> str:
    return "\n\n".join(
        part.get("text", "") for part in item.get("content") or () if isinstance(part, dict)
    )


def template_name(name: str, namespace: str | None) -> str:
    """The name the model sees for a function (namespaced ones carry their namespace)."""
    return f"{namespace}.{name}" if namespace else name


def chat_messages(instructions: str | None, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A conversation of canonical items (stored ones or output items of earlier responses
    too) as the chat template's messages. Leading system and developer messages (and the
    instructions) become one system message, as most templates allow only one, first."""
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    reasoning: list[str] = []
    call_names: dict[str, str] = {}

    def assistant(content: str) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if reasoning:
            message["reasoning_content"] = "\n\n".join(reasoning)
            reasoning.clear()
        messages.append(message)
        return message

    for item in items:
        kind = item.get("type")
        if kind == "reasoning":
            reasoning.append(_reasoning_text(item))
        elif kind == "message":
            if item["role"] == "assistant":
                assistant(_message_text(item))
                continue
            reasoning.clear()  # reasoning replays only into the turn it led to
            if item["role"] == "user":
                messages.append({"role": "user", "content": _user_content(item)})
            else:
                messages.append({"role": "system", "content": _message_text(item)})
        elif kind in CALL_TYPES:
            name = template_name(item["name"], item.get("namespace"))
            arguments = item.get("arguments")
            if arguments is None:
                arguments = json.dumps({"input": item.get("input", "")})
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": name, "arguments": arguments},
            }
            call_names[item["call_id"]] = name
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant" or reasoning:
                last = assistant("")
            last.setdefault("tool_calls", []).append(call)
        elif kind in CALL_OUTPUT_TYPES:
            message = {"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]}
            if item["call_id"] in call_names:
                message["name"] = call_names[item["call_id"]]
            messages.append(message)
    leading = 0
    while leading < len(messages) and messages[leading]["role"] == "system":
        leading += 1
    if leading > 1:
        merged = "\n\n".join(m["content"] for m in messages[:leading] if m["content"])
        messages[:leading] = [{"role": "system", "content": merged}]
    try:
        return normalize_messages(messages)
    except MessageError as exc:  # not expected: the items were checked on the way in
        raise APIError(400, exc.message, param="input") from None


def template_tools(tools: Any) -> tuple[list[dict[str, Any]], dict[str, tuple[str, str]]]:
    """The request's `tools` as the template's function tools, and for each namespaced one
    the (namespace, name) its calls are reported under."""
    if tools is None:
        return [], {}
    if not isinstance(tools, list):
        raise _fail("'tools' must be a list.", "tools")
    functions: list[dict[str, Any]] = []
    namespaced: dict[str, tuple[str, str]] = {}
    for index, tool in enumerate(tools):
        where = f"tools[{index}]"
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind == "function":
            functions.append(_function_tool(tool, where))
        elif kind == "namespace":
            namespace = _string(tool, "name", where)
            inner = tool.get("tools")
            if not isinstance(inner, list):
                raise _fail(f"{where}.tools must be a list.", f"{where}.tools")
            for position, member in enumerate(inner):
                member_where = f"{where}.tools[{position}]"
                member_kind = member.get("type") if isinstance(member, dict) else None
                if member_kind != "function":
                    continue  # custom tools inside a namespace: left out, as at the top level
                function = _function_tool(member, member_where)
                name = function["function"]["name"]
                function["function"]["name"] = template_name(name, namespace)
                namespaced[function["function"]["name"]] = (namespace, name)
                functions.append(function)
        elif not isinstance(kind, str):
            raise _fail(f"{where}.type is required.", f"{where}.type")
        # Any other type is a hosted tool (LEFT_OUT_TOOL_TYPES and newer ones): left out.
    return functions, namespaced


def _function_tool(tool: dict[str, Any], where: str) -> dict[str, Any]:
    """A Responses function tool (flat, or the chat shape under `function`) in chat shape."""
    spec = tool.get("function") if isinstance(tool.get("function"), dict) else tool
    name = spec.get("name")
    if not isinstance(name, str) or not name or len(name) > 200:
        raise _fail(f"{where}.name is required (a string).", f"{where}.name")
    function: dict[str, Any] = {"name": name}
    if isinstance(spec.get("description"), str):
        function["description"] = spec["description"]
    parameters = spec.get("parameters")
    if parameters is not None:
        if not isinstance(parameters, dict):
            raise _fail(f"{where}.parameters must be an object.", f"{where}.parameters")
        function["parameters"] = parameters
    return {"type": "function", "function": function}


def chat_tool_choice(choice: Any, functions: list[dict[str, Any]]) -> tuple[Any, list[dict]]:
    """The request's `tool_choice` in chat shape, and the function tools it leaves the model
    (`allowed_tools` narrows them)."""
    if choice is None or choice in ("auto", "none", "required"):
        return choice, functions
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind == "function" and isinstance(choice.get("name"), str):
        name = template_name(choice["name"], choice.get("namespace"))
        return {"type": "function", "function": {"name": name}}, functions
    if kind == "allowed_tools" and choice.get("mode") in ("auto", "required"):
        allowed = choice.get("tools")
        if not isinstance(allowed, list):
            raise _fail("tool_choice.tools must be a list.", "tool_choice.tools")
        names = {
            template_name(
                t["name"], t.get("namespace") if isinstance(t.get("namespace"), str) else None
            )
            for t in allowed
            if isinstance(t, dict)
            and t.get("type") == "function"
            and isinstance(t.get("name"), str)
        }
        return choice["mode"], [f for f in functions if f["function"]["name"] in names]
    if isinstance(kind, str) and (kind in LEFT_OUT_TOOL_TYPES or kind.startswith("web_search")):
        raise _fail(
            f"tool_choice asks for the hosted tool '{kind}', which this server does not run.",
            "tool_choice",
        )
    raise _fail(
        "tool_choice must be 'auto', 'none', 'required', {\"type\": \"function\", \"name\": ...} "
        'or {"type": "allowed_tools", ...}.',
        "tool_choice",
    )
