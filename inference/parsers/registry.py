"""The one registry of output parsers: the names the admin, `register_model` and the model
validation offer are these, and nothing else.

A model's parsers come from its registry entry; an empty entry means "detect from the chat
template" (`detect_tool_parser`, `detect_reasoning_parser`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from inference.parsers.base import ToolParser
from inference.parsers.harmony import HarmonyParser
from inference.parsers.hermes import HermesToolParser
from inference.parsers.llama3 import Llama3JsonToolParser
from inference.parsers.mistral import MistralToolParser
from inference.parsers.qwen3_coder import Qwen3CoderToolParser
from inference.parsers.reasoning import DeepSeekR1ReasoningParser, ThinkReasoningParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser
    for parser in (
        HermesToolParser,
        Qwen3CoderToolParser,
        Llama3JsonToolParser,
        MistralToolParser,
        HarmonyParser,
    )
}
REASONING_PARSERS: dict[str, type] = {
    "qwen3": ThinkReasoningParser,
    "deepseek_r1": DeepSeekR1ReasoningParser,
    "harmony": HarmonyParser,
}
TOOL_PARSER_LABELS = {
    "hermes": "hermes / qwen (<tool_call>{json}</tool_call>)",
    "qwen3_coder": "qwen3_coder (<function=…><parameter=…>)",
    "llama3_json": "llama3_json (Llama 3.x JSON, <|python_tag|>)",
    "mistral": "mistral ([TOOL_CALLS])",
    "harmony": "harmony (gpt-oss)",
}
REASONING_PARSER_LABELS = {
    "qwen3": "qwen3 (<think>…</think>)",
    "deepseek_r1": "deepseek_r1 (reply starts inside <think>)",
    "harmony": "harmony (gpt-oss analysis channel)",
}


def tool_parser_choices() -> list[tuple[str, str]]:
    return [("", "Detect from the chat template"), *TOOL_PARSER_LABELS.items()]


def reasoning_parser_choices() -> list[tuple[str, str]]:
    return [("", "Detect from the chat template"), *REASONING_PARSER_LABELS.items()]


def detect_tool_parser(chat_template: str) -> str:
    """The tool-call syntax a chat template teaches its model ("" if none is recognised)."""
    if "<|channel|>" in chat_template:
        return "harmony"
    if "<function=" in chat_template and "<parameter=" in chat_template:
        return "qwen3_coder"
    if "<tool_call>" in chat_template:
        return "hermes"
    if "[TOOL_CALLS]" in chat_template:
        return "mistral"
    if "<|python_tag|>" in chat_template or (
        "<|start_header_id|>" in chat_template and '"parameters"' in chat_template
    ):
        return "llama3_json"
    return ""


def detect_reasoning_parser(chat_template: str) -> str:
    if "<|channel|>" in chat_template:
        return "harmony"
    if "<think>" in chat_template or "</think>" in chat_template:
        return "qwen3"
    return ""


@dataclass(frozen=True)
class OutputParsing:
    """How one response's choices are parsed: which parsers, for which tools. Each choice
    gets its own parser instances (`new_tool_parser`, `new_reasoning_parser`)."""

    tool_parser: str = ""  # "" : no tool-call parsing
    reasoning_parser: str = ""  # "" : none
    tools: tuple[dict[str, Any], ...] = ()
    parallel_tool_calls: bool = True
    prompt_tail: str = ""
    model_path: str = ""

    @property
    def harmony(self) -> bool:
        return "harmony" in (self.tool_parser, self.reasoning_parser)

    @property
    def markers(self) -> tuple[str, ...]:
        parser = TOOL_PARSERS.get(self.tool_parser)
        return parser.markers if parser is not None else ()

    def new_tool_parser(self) -> ToolParser | None:
        if self.harmony:
            return HarmonyParser(
                self.tools,
                parallel=self.parallel_tool_calls,
                model_path=self.model_path,
                calls=self.tool_parser == "harmony",
            )
        if not self.tool_parser:
            return None
        return TOOL_PARSERS[self.tool_parser](self.tools, parallel=self.parallel_tool_calls)

    def new_reasoning_parser(self):
        if self.harmony or not self.reasoning_parser:
            return None  # harmony splits reasoning in its tool parser
        return REASONING_PARSERS[self.reasoning_parser](prompt_tail=self.prompt_tail)
