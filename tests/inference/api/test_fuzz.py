"""A fuzz of malformed bodies on every /v1 endpoint: deep nesting, huge and non-finite numbers,
wrong types in every field, truncated and non-UTF-8 bodies, odd model ids. No 5xx, every error
an OpenAI error object, and the server serves a normal request afterwards.

Deterministic: the same mutations every run, so a failure names its body.
"""

import json
import random

import httpx
import pytest

from inference.api.bodies import ERROR_UNPARSABLE
from tests.inference.conftest import TINY

# One token is enough to run a valid mutation end to end. Both size fields, so that a mutation
# of one leaves the reply short (the other bounds it).
CHAT = {
    "model": TINY,
    "messages": [{"role": "user", "content": "Hi"}],
    "max_tokens": 1,
    "max_completion_tokens": 1,
    "temperature": 0,
}
COMPLETION = {"model": TINY, "prompt": "Hi", "max_tokens": 1, "temperature": 0}
# The regex bounds the reply whatever a mutation does to max_output_tokens (a mutation that
# drops it would otherwise generate the rest of the context).
RESPONSE = {
    "model": TINY,
    "input": "Hi",
    "max_output_tokens": 1,
    "temperature": 0,
    "structured_outputs": {"regex": "ok"},
}

# Raw JSON text for values Python's json.dumps cannot write (or writes as non-JSON).
DEEP = "[" * 5000 + "]" * 5000
NESTED_OBJECTS = '{"a":' * 100 + "1" + "}" * 100
HUGE_INT = "9" * 5000
# Values every field is set to: the body parses, and the field's own validation decides.
VALUES = [
    "null",
    "true",
    "0",
    "-1",
    "1.5",
    "1e308",
    "-1e308",
    str(2**63),
    str(2**64 + 1),
    '""',
    '"x"',
    json.dumps("\u0000x"),
    json.dumps("a" * 20000),
    "[]",
    "[1, 2, 3]",
    '["a", "b"]',
    "[[1, 2], [3]]",
    "[null]",
    "{}",
    '{"a": 1}',
    '{"type": "function"}',
]
# Values the strict JSON parser refuses (inference/api/jsonbody.py) before any field is read,
# whatever field holds them: each is tried in one field, a different one for each, and must be
# refused as unparsable (which is what makes trying it in every field redundant).
UNPARSABLE = [
    "1e400",
    "-1e400",
    "NaN",
    "Infinity",
    "-Infinity",
    HUGE_INT,
    "-" + HUGE_INT,
    json.dumps("\u0000\ud800" * 3),
    DEEP,
    NESTED_OBJECTS,
]
CHAT_FIELDS = [
    "model",
    "messages",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "n",
    "stream",
    "stream_options",
    "stop",
    "stop_token_ids",
    "max_tokens",
    "max_completion_tokens",
    "min_tokens",
    "ignore_eos",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "logprobs",
    "top_logprobs",
    "seed",
    "user",
    "response_format",
    "tools",
    "tool_choice",
    "chat_template_kwargs",
]
COMPLETION_FIELDS = [
    "model",
    "prompt",
    "echo",
    "logprobs",
    "suffix",
    "best_of",
    "n",
    "stream",
    "stop",
    "stop_token_ids",
    "max_tokens",
    "seed",
    "logit_bias",
]
MESSAGES = {
    "model": TINY,
    "max_tokens": 2,
    "messages": [{"role": "user", "content": "Hi"}],
    "temperature": 0,
}
MESSAGES_FIELDS = [
    "model",
    "max_tokens",
    "messages",
    "system",
    "stop_sequences",
    "temperature",
    "top_p",
    "top_k",
    "stream",
    "tools",
    "tool_choice",
    "thinking",
    "metadata",
]
RESPONSE_FIELDS = [
    "model",
    "input",
    "instructions",
    "previous_response_id",
    "store",
    "stream",
    "background",
    "max_output_tokens",
    "temperature",
    "top_p",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "text",
    "reasoning",
    "metadata",
    "user",
    "truncation",
    "include",
    "chat_template_kwargs",
]
INPUT_VARIANTS = [
    '[{"type": "message"}]',
    '[{"type": "message", "role": "user", "content": [{"type": "input_text", "text": 5}]}]',
    '[{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]',
    '[{"type": "function_call", "call_id": 5, "name": "f", "arguments": "{}"}]',
    '[{"type": "function_call", "call_id": "c", "name": "f", "arguments": "' + "[" * 3000 + '"}]',
    '[{"type": "function_call", "call_id": "c", "name": "f", "arguments": [1]}]',
    '[{"type": "function_call_output", "call_id": "c", "output": {"a": 1}}]',
    '[{"type": "function_call_output", "call_id": "nobody", "output": "x"}]',
    '[{"type": "reasoning", "summary": 5}]',
    '[{"type": "reasoning", "summary": [{"type": "summary_text"}]}]',
    '[{"type": "custom_tool_call", "call_id": "c", "name": "f", "input": 5}]',
    '[{"type": "nope"}]',
    "[5]",
    '[{"role": "user", "content": ' + DEEP + "}]",
]
TOOL_VARIANTS = [
    '[{"type": "namespace", "name": "ns", "tools": 5}]',
    '[{"type": "namespace", "name": "ns", "tools": [{"type": "function"}]}]',
    '[{"type": "namespace", "tools": []}]',
    '[{"type": "function", "name": "f", "parameters": 5}]',
    '[{"type": "web_search"}, {"type": "function", "name": "' + "f" * 5000 + '"}]',
    "[5]",
]


ANTHROPIC_MESSAGE_VARIANTS = [
    '[{"role": "user", "content": [{"type": "tool_result"}]}]',
    '[{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": 5}]}]',
    '[{"role": "assistant", "content": '
    '[{"type": "tool_use", "id": "t", "name": "f", "input": 5}]}]',
    '[{"role": "assistant", "content": [{"type": "thinking"}]}]',
    '[{"role": "user", "content": [{"type": "document"}]}]',
    '[{"role": "user", "content": [5]}]',
    '[{"role": "user", "content": [{"text": "no type"}]}]',
]
MESSAGE_VARIANTS = [
    '[{"role": "user"}]',
    '[{"role": "user", "content": 5}]',
    '[{"role": "user", "content": [{"type": "text"}]}]',
    '[{"role": "user", "content": [{"type": "text", "text": 5}]}]',
    '[{"role": "user", "content": [5]}]',
    '[{"role": "assistant", "tool_calls": 5}]',
    '[{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "'
    + "[" * 3000
    + '"}}]}]',
    '[{"role": "tool", "content": "x"}]',
    '[{"role": "user", "content": "x", "name": 5}]',
    '[{"role": "user", "content": ' + DEEP + "}]",
]


def with_field(base: dict, name: str, value: str) -> str:
    """`base` as JSON text with field `name` set to the raw JSON `value` (moved to the end)."""
    rest = json.dumps({k: v for k, v in base.items() if k != name})
    return rest[:-1] + f', "{name}": {value}}}' if rest != "{}" else f'{{"{name}": {value}}}'


def unparsable_bodies(base: dict, fields: list[str]) -> list[str]:
    return [with_field(base, fields[i % len(fields)], v) for i, v in enumerate(UNPARSABLE)]


def bodies(base: dict, fields: list[str]) -> list[str]:
    """Every field of `base` set to every value, plus unknown fields and broken documents."""
    out = [with_field(base, name, value) for name in fields for value in VALUES]
    text = json.dumps(base)
    out += [text[:cut] for cut in range(1, len(text), max(1, len(text) // 12))]
    out += [
        "",
        "null",
        "[]",
        '"text"',
        "5",
        DEEP,
        text + "}",
        "{" + text,
        '{"model": ' + DEEP + "}",
    ]
    return out


def check(response: httpx.Response, body: str, *, anthropic: bool = False) -> None:
    assert response.status_code < 500, (response.status_code, body[:300], response.text[:300])
    if response.status_code >= 400:
        assert response.headers["content-type"].startswith("application/json"), body[:300]
        if anthropic:
            assert response.json()["type"] == "error", body[:300]
        error = response.json()["error"]
        keys = {"message", "type"} if anthropic else {"message", "type", "param", "code"}
        assert set(error) == keys, body[:300]
        assert isinstance(error["message"], str) and error["message"]


@pytest.fixture
def http(live_server_url, api_key):
    with httpx.Client(
        base_url=live_server_url,
        headers={"Authorization": f"Bearer {api_key}", "Content-Type": "application/json"},
        timeout=60,
    ) as client:
        yield client


@pytest.mark.parametrize(
    ("path", "base", "fields"),
    [
        ("/v1/chat/completions", CHAT, CHAT_FIELDS),
        ("/v1/completions", COMPLETION, COMPLETION_FIELDS),
        ("/v1/responses", RESPONSE, RESPONSE_FIELDS),
        ("/v1/messages", MESSAGES, MESSAGES_FIELDS),
    ],
)
def test_malformed_bodies_never_give_a_5xx(http, path, base, fields):
    cases = bodies(base, fields)
    if path == "/v1/chat/completions":
        rest = json.dumps({k: v for k, v in base.items() if k != "messages"})
        cases += [rest[:-1] + f', "messages": {m}}}' for m in MESSAGE_VARIANTS]
    if path == "/v1/responses":
        rest = json.dumps({k: v for k, v in base.items() if k != "input"})
        cases += [rest[:-1] + f', "input": {m}}}' for m in INPUT_VARIANTS]
        rest = json.dumps(base)
        cases += [rest[:-1] + f', "tools": {t}}}' for t in TOOL_VARIANTS]
        for choice in ('{"type": "allowed_tools", "mode": "auto", "tools": 5}', '{"type": 5}'):
            cases.append(rest[:-1] + f', "tool_choice": {choice}}}')
    if path == "/v1/messages":
        rest = json.dumps({k: v for k, v in base.items() if k != "messages"})
        cases += [rest[:-1] + f', "messages": {m}}}' for m in ANTHROPIC_MESSAGE_VARIANTS]
    anthropic = path == "/v1/messages"
    statuses = []
    for body in cases:
        response = http.post(path, content=body.encode("utf-8", errors="surrogatepass"))
        check(response, body, anthropic=anthropic)
        statuses.append(response.status_code)
    for raw in (b"\xff\xfe{", b'{"model": "\xff"}', b"\x00" * 64):
        check(http.post(path, content=raw), repr(raw), anthropic=anthropic)
    for body in unparsable_bodies(base, fields):
        response = http.post(path, content=body.encode("utf-8", errors="surrogatepass"))
        check(response, body, anthropic=anthropic)
        assert response.status_code == 400, body[:300]
        assert response.json()["error"]["message"].startswith(ERROR_UNPARSABLE), body[:300]
    assert statuses.count(400) > len(cases) // 2  # the fuzz really reached validation
    assert 200 in statuses  # ...and some mutations are valid requests that ran
    # The server is still whole.
    assert http.post(path, json=base).status_code == 200


def test_odd_model_ids_and_methods(http):
    rng = random.Random(5)
    ids = ["", "%00", "a" * 5000, "..%2F..%2Fetc%2Fpasswd", "x/y/z", "%ff%fe", TINY + "%20"]
    ids += ["".join(chr(rng.randrange(32, 0x2FFF)) for _ in range(20)) for _ in range(5)]
    for model_id in ids:
        check(http.get(f"/v1/models/{model_id}"), model_id)
    for method in ("PUT", "DELETE", "PATCH"):
        for path in ("/v1/models", "/v1/chat/completions", "/v1/completions"):
            check(http.request(method, path, content=b"{}"), f"{method} {path}")
    check(http.get("/v1/models", params={"limit": "[" * 2000}), "query")
    for response_id in ids:
        for method in ("GET", "DELETE"):
            check(http.request(method, f"/v1/responses/{response_id}"), response_id)
        check(http.get(f"/v1/responses/{response_id}/input_items"), response_id)
    for query in ({"limit": "x"}, {"limit": "-1"}, {"order": "sideways"}, {"after": "a" * 5000}):
        check(http.get("/v1/responses/resp_x/input_items", params=query), str(query))
    check(http.put("/v1/responses", content=b"{}"), "PUT /v1/responses")
