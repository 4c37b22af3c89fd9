"""The API's JSON reader (inference/api/jsonbody.py) on its own: what it refuses, and that a
plain body is read without looking at every string."""

import pytest

from inference.api import jsonbody


@pytest.mark.parametrize(
    "raw",
    [
        b'{"a": "\\ud800"}',
        b'{"\\uDFFF": 1}',
        b'{"a": [[{"b": ["x\\udc00y"]}]]}',
        '{"a": "\ud800"}',
        b'{"a": NaN}',
        b'{"a": 1e400}',
        b"[" * 65 + b"]" * 65,
    ],
)
def test_refused(raw):
    with pytest.raises(jsonbody.BodyError):
        jsonbody.loads(raw)


@pytest.mark.parametrize(
    ("raw", "value"),
    [
        (b'{"a": "\\ud83d\\ude00"}', {"a": "\U0001f600"}),
        (b'{"a": "\\\\ud800"}', {"a": "\\ud800"}),
        (b"[" * 64 + b"]" * 64, None),
    ],
)
def test_read(raw, value):
    parsed = jsonbody.loads(raw)
    if value is not None:
        assert parsed == value


def test_a_body_without_surrogate_escapes_skips_the_string_walk(monkeypatch):
    seen = []
    monkeypatch.setattr(jsonbody, "_SURROGATE", type("R", (), {"search": seen.append})())
    jsonbody.loads(b'{"enum": ["a", "b", "c"]}')
    assert seen == []
    jsonbody.loads(b'{"enum": ["a", "\\ud83d\\ude00"]}')
    assert len(seen) > 0


@pytest.mark.parametrize(
    "raw",
    [
        '{"a": "\ud800"}'.encode("utf-8", "surrogatepass"),
        '{"a": "\udc00"}'.encode("utf-16", "surrogatepass"),
    ],
)
def test_a_surrogate_in_the_bodys_own_bytes_is_refused(raw):
    with pytest.raises(jsonbody.BodyError):
        jsonbody.loads(raw)
