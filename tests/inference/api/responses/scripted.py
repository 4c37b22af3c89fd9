"""The scripts the scripted daphne (tests/fixtures/scripted_daphne.py) plays for the /v1/responses
tests, and the Anthropic and Codex ones, and how to start it with them."""

import json

from tests.fixtures.daphne import free_port, server_env, start_daphne

MODEL = "tiny-qwen3-responses"
GPT_OSS = "tiny-gpt-oss-responses"
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
SCRIPTS = [
    {"trigger": "Say hello", "text": "Hello there!"},
    {
        "trigger": "weather in Paris",
        "text": "<think>\nThe user wants the weather.\n</think>\n\n" + CALL_PARIS,
    },
    {"trigger": "Sunny, 21", "text": "It is sunny and 21 °C in Paris."},
    {"trigger": "turn one", "text": "First reply."},
    {"trigger": "turn two", "text": "Second reply."},
    {"trigger": "turn three", "text": "Third reply."},
    {"trigger": "Count slowly", "text": "one two three four five six seven eight nine ten"},
    {"trigger": "crm.lookup_customer", "text": CALL_CRM},
    {"trigger": "Reply with the word pong", "text": "pong"},
    *HARMONY_SCRIPTS,
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
