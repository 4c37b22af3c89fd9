"""A `runengine` worker keeps its models in one memory budget: it loads at start what fits,
reports its budget and each model's state in its beats, and loads another model when a web
process asks for it (an idle one making room); while the loaded model is busy, a request for
the other gets a 503 with Retry-After, never an over-committed worker."""

import httpx
import openai
import pytest

from engine.cache.host import files_bytes
from tests.inference.workers.conftest import Layout

MIB = 1 << 20


@pytest.fixture(scope="module")
def small_layout(django_db_setup, tmp_path_factory, tiny_model_path):
    """One worker whose budget holds one tiny model (weights and caches), and a web process."""
    layout = Layout(tmp_path_factory.mktemp("residency"))
    layout.env.update(
        ORCHARD_MEMORY_BUDGET=str(files_bytes(tiny_model_path) + 400 * MIB),
        ORCHARD_MODEL_CACHE_SHARE="1",
        ORCHARD_MODEL_IDLE_SECONDS="0",
    )
    try:
        yield layout
    finally:
        layout.stop_all()


def states(layout: Layout) -> dict[str, str]:
    beat = layout.beats()["wa"]
    return {name: model.state for name, model in beat.models.items()}


def test_a_worker_loads_what_it_is_asked_for_within_its_budget(
    small_layout, transactional_db, tiny_model_path, make_key
):
    from inference.services.registry import model_register

    layout = small_layout
    model_register(name="tiny-a", path=tiny_model_path, make_default=True)
    model_register(name="tiny-b", path=tiny_model_path)
    key = make_key()
    layout.start_workers(1)
    layout.start_web()
    layout.wait_for(lambda: states(layout).get("tiny-a") == "serving", "the default to load")
    assert states(layout) == {"tiny-a": "serving", "tiny-b": "not_loaded"}
    beat = layout.beats()["wa"]
    assert beat.memory_max_bytes == files_bytes(tiny_model_path) + 400 * MIB
    assert 400 * MIB <= beat.memory_used_bytes <= beat.memory_max_bytes

    chat = openai.OpenAI(base_url=f"{layout.url}/v1", api_key=key, max_retries=0)
    hello = [{"role": "user", "content": "Hi"}]
    # tiny-a has served nothing: it makes room, and the worker loads tiny-b for this request.
    reply = chat.chat.completions.create(model="tiny-b", messages=hello, max_tokens=4)
    assert reply.choices[0].finish_reason == "length"
    layout.wait_for(lambda: states(layout).get("tiny-a") == "not_loaded", "tiny-a to unload")
    assert states(layout)["tiny-b"] == "serving"
    assert layout.beats()["wa"].memory_used_bytes <= layout.beats()["wa"].memory_max_bytes

    # tiny-b is busy (a long stream): no room for tiny-a, a 503 with Retry-After.
    body = {"model": "tiny-b", "messages": hello, "max_tokens": 3000, "stream": True}
    body["ignore_eos"] = True
    headers = {"Authorization": f"Bearer {key}"}
    with httpx.Client(base_url=layout.url, timeout=60) as http:
        with http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as busy:
            lines = busy.iter_lines()
            for _ in range(5):
                next(lines)
            with pytest.raises(openai.APIStatusError) as refused:
                chat.chat.completions.create(model="tiny-a", messages=hello, max_tokens=4)
    assert refused.value.status_code == 503
    assert refused.value.response.headers["retry-after"] == "10"
    assert refused.value.body["code"] == "model_capacity_exceeded"
    assert states(layout)["tiny-b"] == "serving"
