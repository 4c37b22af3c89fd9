"""gpt-oss's harmony format through `openai-harmony`: its encoding (offline), and rendering chat
messages for a harmony model whose tokenizer carries no chat template (gpt-oss's own template
renders exactly what harmony renders).

`openai-harmony` reads its vocabulary from an `o200k_base.tiktoken` file it would download. It
is rebuilt once from the model's own `tokenizer.json` (the gpt-oss tokenizer: base tokens rank
= id, token bytes from the byte-level alphabet), into a folder keyed by the file's digest."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import tempfile
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from engine.text.detokenizer import unicode_to_byte

# o200k's base vocabulary; ids from here on are harmony's special tokens.
NUM_BASE_TOKENS = 199_998
HARMONY_MARKER = "<|channel|>"
_encoding = None
_lock = threading.Lock()


def _cache_root() -> Path:
    return Path(tempfile.gettempdir()) / "orchard-harmony"


def _build_vocabulary(tokenizer_json: Path, folder: Path) -> None:
    vocab = json.loads(tokenizer_json.read_text(encoding="utf-8"))["model"]["vocab"]
    table = unicode_to_byte()
    lines = [
        f"{base64.b64encode(bytes(table[c] for c in token)).decode()} {rank}"
        for token, rank in sorted(vocab.items(), key=lambda item: item[1])
        if rank < NUM_BASE_TOKENS
    ]
    folder.mkdir(parents=True, exist_ok=True)
    staging = folder / f"o200k_base.tiktoken.{os.getpid()}.{threading.get_ident()}"
    staging.write_text("\n".join(lines) + "\n", encoding="utf-8")
    staging.replace(folder / "o200k_base.tiktoken")


def harmony_encoding(model_path: str | Path):
    """The harmony encoding, its vocabulary built from the model's tokenizer on first use."""
    global _encoding
    with _lock:
        if _encoding is not None:
            return _encoding
        tokenizer_json = Path(model_path) / "tokenizer.json"
        digest = hashlib.sha256(tokenizer_json.read_bytes()).hexdigest()[:16]
        folder = _cache_root() / digest
        if not (folder / "o200k_base.tiktoken").exists():
            _build_vocabulary(tokenizer_json, folder)
        os.environ["TIKTOKEN_ENCODINGS_BASE"] = str(folder)
        from openai_harmony import HarmonyEncodingName, load_harmony_encoding

        _encoding = load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)
        return _encoding


def is_harmony_tokenizer(tokenizer: Any) -> bool:
    """A gpt-oss tokenizer without a chat template of its own."""
    if getattr(tokenizer, "has_chat_template", False):
        return False
    vocab = getattr(tokenizer, "get_vocab", None)
    return vocab is not None and HARMONY_MARKER in vocab()


def tokenizer_folder(tokenizer: Any) -> Path:
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    return Path(hf.name_or_path)


def render(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None,
    *,
    add_generation_prompt: bool,
    variables: Mapping[str, Any],
) -> list[int]:
    """Chat messages (OpenAI shape, as normalized by the API) as harmony token ids. System
    messages become the developer instructions; tools the developer's function tools;
    `reasoning_effort` (low / medium / high) the system message's; assistant `tool_calls`
    and `tool` results are commentary messages to and from `functions.NAME`."""
    from openai_harmony import (
        Author,
        Conversation,
        DeveloperContent,
        Message,
        ReasoningEffort,
        Role,
        SystemContent,
        ToolDescription,
    )

    encoding = harmony_encoding(tokenizer_folder(tokenizer))
    system = SystemContent.new()
    effort = variables.get("reasoning_effort")
    if isinstance(effort, str) and effort.lower() in ("low", "medium", "high"):
        system = system.with_reasoning_effort(ReasoningEffort[effort.upper()])
    instructions = "\n\n".join(
        str(m.get("content") or "") for m in messages if m.get("role") == "system"
    )
    developer = DeveloperContent.new()
    if instructions:
        developer = developer.with_instructions(instructions)
    if tools:
        developer = developer.with_function_tools(
            [
                ToolDescription.new(
                    t["function"]["name"],
                    t["function"].get("description") or "",
                    parameters=t["function"].get("parameters"),
                )
                for t in tools
            ]
        )
    rendered = [Message.from_role_and_content(Role.SYSTEM, system)]
    if instructions or tools:
        rendered.append(Message.from_role_and_content(Role.DEVELOPER, developer))
    names: dict[str, str] = {}  # tool call id -> function name, for the results
    for message in messages:
        role, content = message.get("role"), str(message.get("content") or "")
        if role == "user":
            rendered.append(Message.from_role_and_content(Role.USER, content))
        elif role == "assistant":
            reasoning = message.get("reasoning_content") or message.get("reasoning")
            if reasoning:
                rendered.append(
                    Message.from_role_and_content(Role.ASSISTANT, str(reasoning)).with_channel(
                        "analysis"
                    )
                )
            if content:
                rendered.append(
                    Message.from_role_and_content(Role.ASSISTANT, content).with_channel("final")
                )
            for call in message.get("tool_calls") or ():
                function = call["function"]
                arguments = function.get("arguments")
                if not isinstance(arguments, str):
                    arguments = json.dumps(arguments, ensure_ascii=False)
                names[str(call.get("id"))] = function["name"]
                rendered.append(
                    Message.from_role_and_content(Role.ASSISTANT, arguments)
                    .with_channel("commentary")
                    .with_recipient(f"functions.{function['name']}")
                    .with_content_type("<|constrain|>json")
                )
        elif role == "tool":
            name = message.get("name") or names.get(str(message.get("tool_call_id")), "tool")
            rendered.append(
                Message.from_author_and_content(Author.new(Role.TOOL, f"functions.{name}"), content)
                .with_recipient("assistant")
                .with_channel("commentary")
            )
    conversation = Conversation.from_messages(rendered)
    if add_generation_prompt:
        return list(encoding.render_conversation_for_completion(conversation, Role.ASSISTANT))
    return list(encoding.render_conversation(conversation))
