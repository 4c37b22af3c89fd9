"""A request's images read by inference/services/images.py: image URLs fetched together (a
route of the local image server answers only once every fetch of a request is in at once), the
images kept in the parts' order, the first refused part (in order) named by the 400, each URL
read once however often the prompt is rendered, a pixel limit on a request's images together,
and `detail: "low"` scaling an image down."""

import base64
import io
import ipaddress

import pytest
from PIL import Image

from engine import ModelInfo, PromptInput
from inference.errors import APIError
from inference.services.images import FETCH_CONCURRENCY, prompts_with_images
from tests.inference.images.server import JPEG, PNG, picture

PNG_URL = "data:image/png;base64," + base64.b64encode(PNG).decode()
VISION = ModelInfo("vision", 4096, 100, (0,), input_kinds=("text", "image"))


@pytest.fixture
def server(image_server):
    return image_server  # tests/inference/conftest.py


@pytest.fixture(autouse=True)
def fetching(settings):
    settings.ORCHARD_IMAGE_FETCH = True
    settings.ORCHARD_IMAGE_FETCH_ALLOWED_NETWORKS = [str(ipaddress.ip_network("127.0.0.1/32"))]


def prompt(*urls: str) -> PromptInput:
    parts = [
        {"type": "image", "url": url, "param": f"messages[0].content[{index}]"}
        for index, url in enumerate(urls)
    ]
    return PromptInput(messages=({"role": "user", "content": parts},))


async def test_a_requests_image_urls_are_fetched_together_and_kept_in_order(server):
    together = [server.url(f"/together.png?n={FETCH_CONCURRENCY}&i={i}") for i in range(4)]
    jpeg = "data:image/jpeg;base64," + base64.b64encode(JPEG).decode()
    first = prompt(together[0], jpeg, together[1], together[0])
    second = prompt(together[2], together[3])
    server.seen.clear()
    [one, two] = await prompts_with_images([first, second], info=VISION, model="vision")
    assert one.images == (PNG, JPEG, PNG, PNG) and two.images == (PNG, PNG)
    assert one.messages[0]["content"] == [{"type": "image"}] * 4
    assert len(server.paths()) == 4  # a URL carried twice is read once


async def test_the_first_refused_image_in_order_is_the_requests_400(server):
    fine = "data:image/png;base64," + base64.b64encode(PNG).decode()
    slow_refusal = server.url("/trickle.png") + "?then=nothing"
    request = prompt(fine, server.url("/page.html"), server.url("/text.png"), slow_refusal)
    with pytest.raises(APIError) as refused:
        await prompts_with_images([request], info=VISION, model="vision")
    assert refused.value.param == "messages[0].content[1]"


async def test_a_requests_images_are_read_once_however_often_its_prompt_is_rendered(server):
    """A response truncated to fit renders its prompt again: the images it read are reused."""
    server.seen.clear()
    known: dict = {}
    request = prompt(server.url("/red.png"), server.url("/photo.jpg"))
    for _ in range(3):
        [again] = await prompts_with_images([request], info=VISION, model="vision", known=known)
        assert again.images == (PNG, JPEG)
    assert sorted(server.paths()) == ["/photo.jpg", "/red.png"]


async def test_a_requests_images_together_have_a_pixel_limit(server, settings):
    settings.ORCHARD_IMAGE_MAX_REQUEST_PIXELS = 64 * 48 * 2  # two of the server's pictures
    two = prompt(server.url("/red.png"), server.url("/photo.jpg"))
    [read] = await prompts_with_images([two], info=VISION, model="vision")
    assert len(read.images) == 2
    three = prompt(server.url("/red.png"), server.url("/photo.jpg"), server.url("/red.png"))
    with pytest.raises(APIError) as refused:
        await prompts_with_images([three], info=VISION, model="vision")
    assert refused.value.code == "image_too_many_pixels" and "6,144" in refused.value.message


async def test_low_detail_scales_an_image_down_to_512_pixels_on_its_longest_side():
    large = picture("PNG", width=1200, height=600)
    inline = "data:image/png;base64," + base64.b64encode(large).decode()
    parts = [
        {"type": "image", "url": inline, "param": "a", "detail": "low"},
        {"type": "image", "url": inline, "param": "b", "detail": "auto"},
        {"type": "image", "url": inline, "param": "c", "detail": "high"},
        {"type": "image", "url": PNG_URL, "param": "d", "detail": "low"},  # small already
    ]
    request = PromptInput(messages=({"role": "user", "content": parts},))
    [read] = await prompts_with_images([request], info=VISION, model="vision")
    low, auto, high, small = read.images
    assert Image.open(io.BytesIO(low)).size == (512, 256)
    assert auto == high == large and small == PNG


async def test_decoding_and_scaling_are_preparation_jobs_of_the_requests_team():
    """An inline image's decoding and its low-detail scaling grow with the image: they run as
    the request's team's jobs of the fair preparation gate. A team whose job slot is taken
    waits for it; another team's images are read meanwhile."""
    import asyncio
    import functools
    import threading

    from inference.services.prework import FairGate

    gate = FairGate(workers=2, per_team=1, queue_per_team=8)
    parts = [
        {"type": "image", "url": PNG_URL, "param": "a"},
        {"type": "image", "url": PNG_URL, "param": "b", "detail": "low"},
    ]
    request = PromptInput(messages=({"role": "user", "content": parts},))
    held = threading.Event()
    blocker = asyncio.ensure_future(gate.in_thread("A", held.wait, 10))
    await asyncio.sleep(0.05)
    team_a = asyncio.ensure_future(
        prompts_with_images(
            [request], info=VISION, model="vision", run=functools.partial(gate.in_thread, "A")
        )
    )
    [b] = await prompts_with_images(
        [request], info=VISION, model="vision", run=functools.partial(gate.in_thread, "B")
    )
    assert b.images == (PNG, PNG) and not team_a.done()
    assert gate.waiting("A") == 1  # its one decoding (one per URL) waits for the team's slot
    held.set()
    [a] = await team_a
    assert a.images == (PNG, PNG)
    await blocker
