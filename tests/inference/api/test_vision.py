"""Images in prompts through the official SDKs over HTTP, on the tiny SmolVLM and the tiny
Qwen2.5-VL (tests/fixtures/tiny_vision.py): /v1/models says which models take images; OpenAI
chat `image_url` parts (data URLs), Responses `input_image`, Anthropic `image` blocks (base64);
the image reaches the model (another image answers otherwise), image tokens count in usage and a
repeated image is a prefix-cache hit for its own team only; every refusal is a 400 in the
route's own shape saying why (a text-only model, URL fetching off, bytes that are no image, an
image where only text may go)."""

from __future__ import annotations

import base64
import datetime
from decimal import Decimal

import anthropic
import openai
import pytest

from accounts.models import Budget, Team
from inference.models import DailyUsage, ModelEntry
from inference.prices import ModelPrice
from inference.services.registry import model_register
from tests.fixtures.tiny_vision import (
    build_tiny_qwen_vision_model,
    build_tiny_vision_model,
    image_bytes,
)
from tests.inference.api.test_chat import finished_row
from tests.inference.conftest import TINY

VISION = "tiny-vision"
RED, BLUE = image_bytes("red"), image_bytes("navy", mark=6)
ASK = {"temperature": 0, "max_tokens": 6, "extra_body": {"ignore_eos": True}}


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def claude_image(data: bytes) -> dict:
    """An Anthropic image block of PNG bytes, base64."""
    source = {"type": "base64", "media_type": "image/png", "data": base64.b64encode(data).decode()}
    return {"type": "image", "source": source}


def look(image: bytes, text: str = "What is in this picture?") -> list[dict]:
    return [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": text},
                {"type": "image_url", "image_url": {"url": data_url(image), "detail": "low"}},
            ],
        }
    ]


@pytest.fixture
def clients(live_server_url, make_key, tiny_models) -> dict[str, openai.OpenAI]:
    model_register(name=VISION, path=str(build_tiny_vision_model()))

    def client(user: str, team: str) -> openai.OpenAI:
        key = make_key(user, team)
        return openai.OpenAI(base_url=f"{live_server_url}/v1", api_key=key, max_retries=0)

    return {"a": client("alice", "team-a"), "b": client("bob", "team-b")}


def test_chat_answers_an_image_and_counts_and_caches_its_tokens(clients):
    team_a, team_b = clients["a"], clients["b"]
    kinds = {m.id: m.model_extra["input_kinds"] for m in team_a.models.list()}
    assert kinds[VISION] == ["text", "image"] and kinds[TINY] == ["text"]
    text_only = team_a.chat.completions.create(
        model=VISION, messages=[{"role": "user", "content": "What is in this picture?"}], **ASK
    )
    first = team_a.chat.completions.create(
        model=VISION, messages=look(RED), logprobs=True, top_logprobs=3, **ASK
    )
    # The image is 7 tokens: its 4 placeholders and SmolVLM's wrapper tokens around them.
    assert first.usage.prompt_tokens == text_only.usage.prompt_tokens + 7
    assert first.usage.prompt_tokens_details.cached_tokens < first.usage.prompt_tokens - 7
    again = team_a.chat.completions.create(
        model=VISION, messages=look(RED), logprobs=True, top_logprobs=3, **ASK
    )
    assert again.choices[0].message.content == first.choices[0].message.content
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens - 1
    other = team_a.chat.completions.create(
        model=VISION, messages=look(BLUE), logprobs=True, top_logprobs=3, **ASK
    )
    top = [[t.logprob for t in c.top_logprobs] for c in first.choices[0].logprobs.content]
    assert top != [[t.logprob for t in c.top_logprobs] for c in other.choices[0].logprobs.content]
    # Another team sending the same image reuses nothing of team A's.
    theirs = team_b.chat.completions.create(model=VISION, messages=look(RED), **ASK)
    assert theirs.usage.prompt_tokens_details.cached_tokens == 0
    assert theirs.choices[0].message.content == first.choices[0].message.content
    streamed = team_b.chat.completions.create(model=VISION, messages=look(RED), stream=True, **ASK)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in streamed if chunk.choices)
    assert text == first.choices[0].message.content


def test_a_qwen_vl_model_answers_images_of_any_shape_on_every_route(clients, live_server_url):
    """Qwen2.5-VL (positions along each image's grid): two images of different shapes in one
    message; streamed and not, chat and messages answer alike; a repeated prompt is a hit."""
    model_register(name="tiny-qwen-vision", path=str(build_tiny_qwen_vision_model()))
    wide = image_bytes("green", (100, 40), mark=30)
    two = look(RED)
    two[0]["content"].append({"type": "image_url", "image_url": {"url": data_url(wide)}})
    team_a = clients["a"]
    plain = team_a.chat.completions.create(
        model="tiny-qwen-vision", messages=[{"role": "user", "content": "Hi"}], **ASK
    )
    first = team_a.chat.completions.create(model="tiny-qwen-vision", messages=two, **ASK)
    # 6 and 8 placeholders (each 28 px cell of the resized images), each image between the
    # vision start and end tokens; the text differs from "Hi" by a few tokens.
    assert first.usage.prompt_tokens - plain.usage.prompt_tokens >= 6 + 8 + 4
    stream = team_a.chat.completions.create(
        model="tiny-qwen-vision", messages=two, stream=True, **ASK
    )
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert streamed == first.choices[0].message.content
    again = team_a.chat.completions.create(model="tiny-qwen-vision", messages=two, **ASK)
    assert again.choices[0].message.content == first.choices[0].message.content
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens - 1
    claude = anthropic.Anthropic(base_url=live_server_url, api_key=team_a.api_key, max_retries=0)
    blocks = [
        {"type": "text", "text": "What is in this picture?"},
        claude_image(RED),
        claude_image(wide),
    ]
    message = claude.messages.create(
        model="tiny-qwen-vision",
        max_tokens=6,
        messages=[{"role": "user", "content": blocks}],
        extra_body={"ignore_eos": True, "temperature": 0},
    )
    assert message.content[0].text == first.choices[0].message.content
    usage = message.usage  # (Anthropic's input_tokens leave out what the cache read)
    assert usage.input_tokens + usage.cache_read_input_tokens == first.usage.prompt_tokens


def test_responses_and_messages_take_images_too(clients, live_server_url, make_key):
    chat = clients["a"].chat.completions.create(model=VISION, messages=look(RED), **ASK)
    response = clients["a"].responses.create(
        model=VISION,
        input=[
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "What is in this picture?"},
                    {"type": "input_image", "image_url": data_url(RED), "detail": "auto"},
                ],
            }
        ],
        temperature=0,
        max_output_tokens=6,
        extra_body={"ignore_eos": True},
    )
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    claude = anthropic.Anthropic(
        base_url=live_server_url, api_key=make_key("carol", "team-c"), max_retries=0
    )
    claude_look = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is in this picture?"},
                claude_image(RED),
            ],
        }
    ]
    message = claude.messages.create(
        model=VISION,
        max_tokens=6,
        messages=claude_look,
        extra_body={"ignore_eos": True, "temperature": 0},
    )
    assert message.usage.input_tokens == chat.usage.prompt_tokens
    assert message.content[0].text == chat.choices[0].message.content
    counted = claude.messages.count_tokens(
        model=VISION,
        messages=claude_look,
    )
    assert counted.input_tokens == chat.usage.prompt_tokens  # the image's tokens included


def test_images_the_server_cannot_take_are_refused_with_the_reason(
    clients, live_server_url, make_key
):
    client = clients["a"]

    def refused(model: str, messages: list[dict]) -> openai.BadRequestError:
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model=model, messages=messages, max_tokens=2)
        return caught.value

    text_model = refused(TINY, look(RED))
    assert text_model.code == "image_input_not_supported" and TINY in text_model.message
    fetch = refused(
        VISION,
        [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}
                ],
            }
        ],
    )
    assert fetch.code == "image_fetch_disabled"
    assert fetch.param == "messages[0].content[0].image_url.url"
    not_image = refused(VISION, look(b"just some text, not an image"))
    assert not_image.code is not None and "image" in not_image.message.lower()
    assistant = refused(
        VISION,
        [
            {"role": "user", "content": "hi"},
            {
                "role": "assistant",
                "content": [{"type": "image_url", "image_url": {"url": data_url(RED)}}],
            },
        ],
    )
    assert assistant.param == "messages[1].content[0].type"
    claude = anthropic.Anthropic(
        base_url=live_server_url, api_key=make_key("dan", "team-d"), max_retries=0
    )
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude.messages.create(
            model=TINY,
            max_tokens=2,
            messages=[
                {
                    "role": "user",
                    "content": [claude_image(RED)],
                }
            ],
        )
    assert caught.value.body["type"] == "error"
    assert "takes no images" in caught.value.body["error"]["message"]


def test_images_are_metered_on_the_usage_row_priced_per_image(clients):
    ModelPrice.objects.create(
        model=ModelEntry.objects.get(name=VISION),
        effective_from=datetime.datetime(2020, 1, 1, tzinfo=datetime.UTC),
        input_per_million=Decimal("0"),
        output_per_million=Decimal("0"),
        per_image=Decimal("0.01"),
    )
    client = clients["a"]
    two = look(RED)
    two[0]["content"].append({"type": "image_url", "image_url": {"url": data_url(BLUE)}})
    raw = client.chat.completions.with_raw_response.create(model=VISION, messages=two, **ASK)
    row = finished_row(raw.headers["x-request-id"])
    assert row.images == 2
    assert row.input_cost == 2 * 10_000_000  # 0.01 a image, in nano-units
    text = client.chat.completions.with_raw_response.create(
        model=VISION, messages=[{"role": "user", "content": "hi"}], **ASK
    )
    assert finished_row(text.headers["x-request-id"]).images == 0
    daily = DailyUsage.objects.filter(model=VISION, api_key_id=row.api_key_id)
    assert sum(d.images for d in daily) == 2


def test_a_money_budget_reserves_the_images_price_before_they_run(clients):
    """Images priced apart from tokens are reserved up front: a request whose images would
    pass the team's money budget is refused before it runs, not billed past it."""
    ModelPrice.objects.create(
        model=ModelEntry.objects.get(name=VISION),
        effective_from=datetime.datetime(2020, 1, 1, tzinfo=datetime.UTC),
        input_per_million=Decimal("0"),
        output_per_million=Decimal("0"),
        per_image=Decimal("0.6"),
    )
    Budget.objects.create(
        team=Team.objects.get(name="team-a"), scope="team", unit="money", amount=Decimal("1")
    )
    client = clients["a"]
    raw = client.chat.completions.with_raw_response.create(model=VISION, messages=look(RED), **ASK)
    assert finished_row(raw.headers["x-request-id"]).input_cost == 600_000_000
    with pytest.raises(openai.RateLimitError) as refused:  # 0.6 spent, 0.6 more is over 1
        client.chat.completions.create(model=VISION, messages=look(BLUE), **ASK)
    assert "team's monthly money budget is exhausted" in refused.value.message
    text = client.chat.completions.create(
        model=VISION, messages=[{"role": "user", "content": "hi"}], **ASK
    )
    assert text.choices[0].message.content  # tokens are free: text still runs
    assert clients["b"].chat.completions.create(model=VISION, messages=look(BLUE), **ASK).choices


def test_a_server_that_fetches_image_urls_reaches_allowed_hosts_only(
    transactional_db, make_key, tiny_models, tmp_path
):
    """With ORCHARD_IMAGE_FETCH on and 127.0.0.1 allowed (an intranet image host), an image URL
    there is fetched and answered; 127.0.0.2, loopback too but not allowed, is refused before
    any connection (the image server sees nothing)."""
    from tests.fixtures.daphne import daphne_servers, server_env
    from tests.inference.images.server import ImageServer

    model_register(name=VISION, path=str(build_tiny_vision_model()))
    images = ImageServer()
    env = {
        **server_env(),
        "ORCHARD_IMAGE_FETCH": "1",
        "ORCHARD_IMAGE_FETCH_ALLOWED_NETWORKS": "127.0.0.1/32",
    }
    key = make_key("erin", "team-e")
    try:
        with daphne_servers(1, env, tmp_path) as (url,):
            client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)

            def ask(image_url: str):
                part = {"type": "image_url", "image_url": {"url": image_url}}
                return client.chat.completions.create(
                    model=VISION, messages=[{"role": "user", "content": [part]}], max_tokens=2
                )

            assert ask(images.url("/red.png")).usage.prompt_tokens > 7
            assert images.paths() == ["/red.png"]
            with pytest.raises(openai.BadRequestError) as refused:
                ask(images.url("/red.png", host="127.0.0.2"))
            assert refused.value.code == "image_address_not_allowed"
            assert images.paths() == ["/red.png"]
    finally:
        images.close()
