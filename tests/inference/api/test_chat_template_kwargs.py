"""`chat_template_kwargs` must reach the chat template on every path (a silently dropped
`enable_thinking` was a real bug elsewhere). The Qwen3 template renders an empty think block into
the generation prompt when enable_thinking is false, so the prompt token count shows whether the
kwargs arrived: a black-box spy on the real template."""

import pytest
from transformers import PreTrainedTokenizerFast

from tests.fixtures.tiny_models import tokenizer_dir
from tests.inference.conftest import TINY, TINY_SIMPLE

MESSAGES = [{"role": "user", "content": "Hello there"}]


def expected_prompt_tokens(tokenizer, **kwargs) -> int:
    text = tokenizer.apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=False, **kwargs
    )
    return len(tokenizer.encode(text, add_special_tokens=False))


@pytest.fixture(scope="module")
def counts():
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(tokenizer_dir("qwen3")))
    thinking_off = expected_prompt_tokens(tokenizer, enable_thinking=False)
    default = expected_prompt_tokens(tokenizer)
    assert thinking_off > default  # the spy only works if the template reacts
    return default, thinking_off


def prompt_tokens(client, model, stream, **extra):
    kwargs = {"model": model, "messages": MESSAGES, "max_tokens": 2, "temperature": 0}
    if stream:
        chunks = list(
            client.chat.completions.create(
                stream=True, stream_options={"include_usage": True}, **kwargs, **extra
            )
        )
        return chunks[-1].usage.prompt_tokens
    return client.chat.completions.create(**kwargs, **extra).usage.prompt_tokens


@pytest.mark.parametrize("model", [TINY, TINY_SIMPLE])
@pytest.mark.parametrize("stream", [False, True])
def test_enable_thinking_reaches_the_template(client, counts, model, stream):
    default, thinking_off = counts
    off = {"extra_body": {"chat_template_kwargs": {"enable_thinking": False}}}
    assert prompt_tokens(client, model, stream) == default
    assert prompt_tokens(client, model, stream, **off) == thinking_off


@pytest.mark.django_db(transaction=True)
async def test_the_render_time_limit_is_applied_to_requests(
    settings, tiny_model_path, sync_thread_db
):
    """In process, with a tiny limit: a long conversation takes longer than that to render."""
    from asgiref.sync import sync_to_async
    from django.test import AsyncClient

    from accounts.services import api_key_create, team_membership_ensure, user_get_or_create
    from inference.services.registry import model_register

    def setup() -> str:
        user = user_get_or_create(username="slow-renders")
        team, _ = team_membership_ensure(user=user, team_name="slow-renders")
        model_register(name=TINY, path=tiny_model_path)
        return api_key_create(user=user, team=team)[1]

    raw = await sync_to_async(setup)()
    settings.ORCHARD_RENDER_TIMEOUT_SECONDS = 0.05
    conversation = [
        {"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i}"}
        for i in range(20_000)
    ]
    response = await AsyncClient().post(
        "/v1/chat/completions",
        {"model": TINY, "messages": conversation, "max_tokens": 1},
        content_type="application/json",
        headers={"Authorization": f"Bearer {raw}"},
    )
    assert response.status_code == 400, response.content
    error = response.json()["error"]
    assert error["param"] == "messages" and "longer than 0.05 s" in error["message"]
