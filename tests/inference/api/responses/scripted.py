"""The scripts the scripted daphne (tests/fixtures/scripted_daphne.py) plays for the API tests
(/v1/responses, chat tool calls, Anthropic, Codex), the models they are played on, and how to
start it with them. One server plays them all (`scripted_url`, tests/inference/conftest.py), so
no two scripts share a trigger, and the models have one name each: each loads once."""

import json

from tests.fixtures.daphne import free_port, server_env, start_daphne

# The tiny Qwen3 (real tokenizer and template) and gpt-oss models the scripts are played on.
MODEL = "tiny-qwen3-scripted"
GPT_OSS = "tiny-gpt-oss-scripted"
# gpt-oss (harmony): a call after its analysis, then the answer to the call's result.
HARMONY_SCRIPTS = [
    {
        "trigger": "weather in Berlin",
        "text": "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant"
        "<|channel|>commentary to=functions.get_weather <|constrain|>json"
        '<|message|>{"city": "Berlin"}<|call|>',
    },
    {
        "trigger": "Cloudy, 12",
        "text": "<|channel|>analysis<|message|>Report it.<|end|><|start|>assistant"
        "<|channel|>final<|message|>Cloudy and 12 °C in Berlin.<|return|>",
    },
]
CALL_CRM = '<tool_call>\n{"name": "crm.lookup_customer", "arguments": {"id": 7}}\n</tool_call>'
CALL_PARIS = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
CALL_ROME = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
THINK = "<think>\nThe user wants the weather.\n</think>\n\n"
# Chat completions' tool calls (tests/inference/api/test_tool_calls.py): content before the call.
TOOL_CALL_SCRIPTS = [
    {"trigger": "weather like in Paris", "text": THINK + "Let me check." + CALL_PARIS},
    {"trigger": "two cities", "text": CALL_PARIS + "\n" + CALL_ROME},
    {"trigger": "broken call", "text": "<tool_call>\n{not json}\n</tool_call>"},
    {"trigger": "no thinking please", "text": "Just the answer."},
    {
        "trigger": "llama weather",
        "text": '{"name": "get_weather", "parameters": {"city": "Oslo"}}',
    },
]
SCRIPTS = [
    {"trigger": "Say hello", "text": "Hello there!"},
    {"trigger": "weather in Paris", "text": THINK + CALL_PARIS},
    {"trigger": "Sunny, 21", "text": "It is sunny and 21 °C in Paris."},
    {"trigger": "turn one", "text": "First reply."},
    {"trigger": "turn two", "text": "Second reply."},
    {"trigger": "turn three", "text": "Third reply."},
    {"trigger": "Count slowly", "text": "one two three four five six seven eight nine ten"},
    {"trigger": "crm.lookup_customer", "text": CALL_CRM},
    {"trigger": "Reply with the word pong", "text": "pong"},
    *HARMONY_SCRIPTS,
    *TOOL_CALL_SCRIPTS,
]
WEATHER_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}


def start_scripted(folder):
    scripts = folder / "scripts.json"
    scripts.write_text(json.dumps(SCRIPTS))
    port = free_port()
    process = start_daphne(
        port=port,
        env={**server_env(), "ORCHARD_TEST_SCRIPTS": str(scripts)},
        log_path=folder / f"server-{port}.log",
        module="tests.fixtures.scripted_daphne",
    )
    return process, f"http://127.0.0.1:{port}"
