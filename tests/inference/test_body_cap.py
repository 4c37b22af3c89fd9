"""The body cap in front of Django (inference/body_cap.py): over real HTTP against the live
daphne, a body over the cap is a 413 in the endpoint's error shape before its key is looked at
(by its Content-Length, or counted as a chunked body arrives), one just under it goes on to the
view, the pages get a plain 413, and one team's stream of oversized bodies leaves another team's
requests answered; on the ASGI messages themselves, the cap stops receiving where the body
passes it and never starts the application."""

import json
import threading

import httpx
import pytest
from django.conf import settings

from inference.body_cap import BodyCapMiddleware

CAP = settings.ORCHARD_MAX_BODY_BYTES
EMBEDDINGS_CAP = settings.ORCHARD_MAX_EMBEDDINGS_BODY_BYTES


def assert_openai_413(response: httpx.Response) -> None:
    assert response.status_code == 413, response.text
    assert response.headers["x-request-id"].startswith("req_")
    error = response.json()["error"]
    assert error == {
        "message": error["message"],
        "type": "invalid_request_error",
        "param": None,
        "code": "request_too_large",
    }
    assert str(CAP) in error["message"]


def assert_anthropic_413(response: httpx.Response) -> None:
    assert response.status_code == 413, response.text
    body = response.json()
    assert body["type"] == "error" and body["error"]["type"] == "request_too_large"
    assert str(CAP) in body["error"]["message"]


@pytest.mark.parametrize(
    ("path", "check"),
    [
        ("chat/completions", assert_openai_413),
        ("responses", assert_openai_413),
        ("messages", assert_anthropic_413),
        ("messages/count_tokens", assert_anthropic_413),
    ],
)
def test_a_body_over_the_cap_is_refused_in_the_endpoints_shape_before_the_key(
    live_server_url, make_key, path, check
):
    body = b"x" * (CAP + 1)
    # No key at all: the 413 comes before authentication (else this would be a 401).
    check(httpx.post(f"{live_server_url}/v1/{path}", content=body, timeout=60))
    headers = {"Authorization": f"Bearer {make_key()}", "x-api-key": "sk-orch-unknown"}
    check(httpx.post(f"{live_server_url}/v1/{path}", content=body, headers=headers, timeout=60))


def test_a_chunked_body_is_counted_as_it_arrives(live_server_url):
    def chunks(total: int, size: int = 64 * 1024):
        sent = 0
        while sent < total:
            yield b"x" * min(size, total - sent)
            sent += size

    request = httpx.Request(
        "POST", f"{live_server_url}/v1/chat/completions", content=chunks(CAP + 1)
    )
    assert "content-length" not in request.headers  # Transfer-Encoding: chunked
    with httpx.Client(timeout=60) as client:
        assert_openai_413(client.send(request))
        # Just under the cap, chunked: no key, so the view's 401 shows it got through.
        ok = httpx.Request("POST", f"{live_server_url}/v1/chat/completions", content=chunks(CAP))
        assert client.send(ok).status_code == 401


def test_a_body_just_under_the_cap_goes_on_to_the_view(live_server_url, make_key):
    headers = {"Authorization": f"Bearer {make_key()}", "Content-Type": "application/json"}
    body = b"{" + b" " * (CAP - 1)  # not JSON: the view's 400 shows it was read and parsed
    response = httpx.post(
        f"{live_server_url}/v1/chat/completions", content=body, headers=headers, timeout=60
    )
    assert response.status_code == 400, response.text
    assert "could not parse the JSON body" in response.json()["error"]["message"]
    # /v1/embeddings has a cap of its own.
    assert EMBEDDINGS_CAP > CAP
    body = b"{" + b" " * (EMBEDDINGS_CAP - 1)
    response = httpx.post(
        f"{live_server_url}/v1/embeddings", content=body, headers=headers, timeout=60
    )
    assert response.status_code == 400, response.text
    response = httpx.post(
        f"{live_server_url}/v1/embeddings", content=body + b" ", headers=headers, timeout=60
    )
    assert response.status_code == 413 and str(EMBEDDINGS_CAP) in response.text


def test_pages_and_the_admin_get_a_plain_413(live_server_url):
    response = httpx.post(f"{live_server_url}/admin/login/", content=b"x" * (CAP + 1), timeout=60)
    assert response.status_code == 413
    assert response.headers["content-type"].startswith("text/plain")
    assert httpx.get(f"{live_server_url}/admin/login/", timeout=30).status_code == 200


def test_one_teams_oversized_bodies_leave_another_teams_requests_answered(
    live_server_url, make_key
):
    key_a, key_b = make_key("ann", "team-a"), make_key("bob", "team-b")
    stop = threading.Event()
    refused = []

    def flood() -> None:
        body = b"x" * (8 * 1024 * 1024)
        headers = {"Authorization": f"Bearer {key_a}"}
        with httpx.Client(timeout=60) as client:
            while not stop.is_set():
                response = client.post(
                    f"{live_server_url}/v1/chat/completions", content=body, headers=headers
                )
                refused.append(response.status_code)

    threads = [threading.Thread(target=flood) for _ in range(2)]
    for thread in threads:
        thread.start()
    try:
        with httpx.Client(timeout=30) as client:
            while len(refused) < 4:
                assert all(thread.is_alive() for thread in threads)
                answers = [
                    client.get(
                        f"{live_server_url}/v1/models",
                        headers={"Authorization": f"Bearer {key_b}"},
                    ).status_code
                    for _ in range(3)
                ]
                assert answers == [200, 200, 200]
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=60)
    assert set(refused) == {413}


class Script:
    """An ASGI server's side of one request: the body's messages, and what was sent back."""

    def __init__(self, chunks: list[bytes], *, content_length: int | None = None):
        self.messages = [
            {"type": "http.request", "body": chunk, "more_body": i < len(chunks) - 1}
            for i, chunk in enumerate(chunks)
        ]
        self.num_received = 0
        self.sent: list[dict] = []
        headers = [] if content_length is None else [(b"content-length", b"%d" % content_length)]
        self.headers = headers

    def scope(self, path: str) -> dict:
        return {"type": "http", "path": path, "headers": self.headers}

    async def receive(self) -> dict:
        self.num_received += 1
        if self.num_received <= len(self.messages):
            return self.messages[self.num_received - 1]
        return {"type": "http.disconnect"}

    async def send(self, message: dict) -> None:
        self.sent.append(message)


async def never_called(scope, receive, send):
    raise AssertionError("the application ran")


async def test_the_cap_stops_receiving_where_the_body_passes_it():
    cap = BodyCapMiddleware(never_called, max_bytes=10_000)
    script = Script([b"x" * 1000] * 100)
    await cap(script.scope("/v1/chat/completions"), script.receive, script.send)
    assert script.num_received == 11  # 11,000 bytes: the rest never asked for
    start, body = script.sent
    assert start["status"] == 413 and (b"connection", b"close") in start["headers"]
    assert json.loads(body["body"])["error"]["code"] == "request_too_large"

    declared = Script([b"x"], content_length=10_001)
    await cap(declared.scope("/v1/messages"), declared.receive, declared.send)
    assert declared.num_received == 0  # refused on its Content-Length alone
    assert json.loads(declared.sent[1]["body"])["error"]["type"] == "request_too_large"


async def test_a_body_within_the_cap_reaches_the_application_as_it_came():
    seen = []

    async def app(scope, receive, send):
        body = b""
        while (message := await receive())["type"] == "http.request":
            body += message["body"]
            if not message["more_body"]:
                seen.append(body)
        seen.append(message["type"])

    cap = BodyCapMiddleware(app, max_bytes=10, route_max_bytes={"/v1/embeddings": 20})
    script = Script([b"0123456789", b"abcdefghi"])
    await cap(script.scope("/v1/embeddings"), script.receive, script.send)
    assert seen == [b"0123456789abcdefghi", "http.disconnect"]
    elsewhere = Script([b"0123456789", b"abcdefghi"])
    await cap(elsewhere.scope("/v1/completions"), elsewhere.receive, elsewhere.send)
    assert elsewhere.sent[0]["status"] == 413 and len(seen) == 2
    # A body with its length goes to the application untouched: nothing read ahead of it.
    declared = Script([b"0123456789"], content_length=10)
    await cap(declared.scope("/v1/completions"), declared.receive, declared.send)
    assert seen[-2:] == [b"0123456789", "http.disconnect"] and declared.num_received == 2
    # A large chunked upload is kept in a file past its first MiB and arrives whole.
    seen.clear()
    parts = [bytes([i]) * 65_536 for i in range(48)]  # 3 MiB
    large = Script(parts)
    roomy = BodyCapMiddleware(app, max_bytes=4 << 20)
    await roomy(large.scope("/v1/files"), large.receive, large.send)
    assert seen == [b"".join(parts), "http.disconnect"]
