"""A web process stopped with SIGTERM while it streams exits promptly and finishes the usage row
of the request it cut off (failed, `server_shutdown`, with the tokens sent so far): nothing is
left in progress for the next start's sweep."""

import time

import httpx
import pytest

from inference.models import UsageRecord
from inference.services.registry import model_register
from inference.services.settlement import ERROR_SERVER_SHUTDOWN
from tests.fixtures.daphne import free_port, server_env, start_daphne
from tests.inference.conftest import TINY


@pytest.mark.django_db(transaction=True)
def test_sigterm_mid_stream_exits_and_finishes_the_usage_row(make_key, tiny_model_path, tmp_path):
    # The one model the test needs: the server loads every enabled model as it starts.
    model_register(name=TINY, path=tiny_model_path, make_default=True)
    api_key = make_key()
    port = free_port()
    server = start_daphne(port=port, env=server_env(), log_path=tmp_path / "server.log")
    try:
        body = {
            "model": TINY,
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 3000,
            "stream": True,
            "ignore_eos": True,
        }
        headers = {"Authorization": f"Bearer {api_key}"}
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as http:
            with http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
                lines = r.iter_lines()
                for _ in range(10):
                    next(lines)
                server.terminate()
                stopped = time.monotonic()
                with pytest.raises(httpx.HTTPError):
                    for line in lines:
                        assert line != "data: [DONE]"
        assert server.wait(timeout=20) == 0
        assert time.monotonic() - stopped < 15
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    row = UsageRecord.objects.get()
    assert row.status == UsageRecord.Status.FAILED
    assert row.error_code == ERROR_SERVER_SHUTDOWN
    assert 0 < row.completion_tokens < 3000
    assert row.finished_at is not None
