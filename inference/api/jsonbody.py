"""Strict JSON for request bodies: what a parser cannot take is a ValueError, never a 500.

Python's `json` accepts `NaN` and `Infinity` (not JSON), raises RecursionError on deep nesting,
and ValueError on integers past its digit limit; it also decodes `"\\ud800"` into a lone
surrogate, which no tokenizer can encode; and a body that parses can still be nested deeper than
the code that walks it (serializers, templates' `tojson`) should recurse. So: no non-finite
constants, no lone surrogates, and no more than MAX_DEPTH levels of arrays and objects.

Never on the event loop: a body at the cap (ORCHARD_MAX_BODY_BYTES, 4 MiB) took, measured here,
15 ms as one long string, 125 ms as 60,000 short messages and 225 ms as embeddings' token-id
arrays (plain `json.loads`: 5, 30 and 60 ms), so views parse through `read_body`
(inference/api/common.py) on a preparation thread, with the serializer's check.
"""

import json
import math
import re
from typing import Any

MAX_DEPTH = 64
_SURROGATE = re.compile("[\ud800-\udfff]")
# Where a lone surrogate can come from in a UTF-8 body: an escape (`\\uD800`-`\\uDFFF`), or the
# bytes of one (json.loads decodes bytes with "surrogatepass"). A body with neither needs no
# look at its strings (a 3 MiB enum: 30 ms instead of 190).
_SURROGATE_SOURCE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")


class BodyError(ValueError):
    pass


def _reject_constant(name: str) -> Any:
    raise BodyError(f"{name} is not valid JSON.")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e400
        raise BodyError(f"The number {text[:40]} is out of range.")
    return value


def loads(raw: bytes | str) -> Any:
    """Parse `raw`, raising BodyError for anything that is not plain, finite JSON nested at
    most MAX_DEPTH levels."""
    try:
        value = json.loads(raw, parse_constant=_reject_constant, parse_float=_finite_float)
    except BodyError:
        raise
    except RecursionError:
        raise BodyError(f"The JSON is nested more than {MAX_DEPTH} levels deep.") from None
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError, integer digit limits
        raise BodyError(f"The body is not valid JSON: {exc}") from None
    if isinstance(raw, str):
        strings = True
    else:
        utf8 = json.detect_encoding(raw) == "utf-8"
        # find() first: a scan for two fixed bytes is a fraction of the pattern's cost.
        maybe = b"\\u" in raw or b"\xed" in raw
        strings = not utf8 or (maybe and _SURROGATE_SOURCE.search(raw) is not None)
        if not strings and raw.count(b"[") + raw.count(b"{") <= MAX_DEPTH:
            return value  # too few brackets to nest deeper than MAX_DEPTH
    _check(value, strings=strings)
    return value


def _check(value: Any, *, strings: bool) -> None:
    """Walk `value` without recursion: its depth, and (with `strings`) every string, keys
    included."""
    stack = [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, str):
            if _SURROGATE.search(item):
                raise BodyError("The JSON has a string that is not valid Unicode.")
            continue
        if isinstance(item, dict):
            children = [*item.keys(), *item.values()] if strings else item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        if level > MAX_DEPTH:
            raise BodyError(f"The JSON is nested more than {MAX_DEPTH} levels deep.")
        if strings:
            stack.extend((child, level + 1) for child in children)
        else:
            stack.extend((c, level + 1) for c in children if isinstance(c, dict | list))
