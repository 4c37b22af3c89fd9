"""Strict JSON for request bodies: what a parser cannot take is a ValueError, never a 500.

Python's `json` accepts `NaN` and `Infinity` (not JSON), raises RecursionError on deep nesting,
and ValueError on integers past its digit limit; it also decodes `"\\ud800"` into a lone
surrogate, which no tokenizer can encode; and a body that parses can still be nested deeper than
the code that walks it (serializers, templates' `tojson`) should recurse. So: no non-finite
constants, no lone surrogates, and no more than MAX_DEPTH levels of arrays and objects.
"""

import json
import math
import re
from typing import Any

MAX_DEPTH = 64
_SURROGATE = re.compile("[\ud800-\udfff]")


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
    _check(value)
    return value


def _check(value: Any) -> None:
    """Walk `value` without recursion: its depth, and every string (keys included)."""
    stack = [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, str):
            if _SURROGATE.search(item):
                raise BodyError("The JSON has a string that is not valid Unicode.")
            continue
        if isinstance(item, dict):
            children = [*item.keys(), *item.values()]
        elif isinstance(item, list):
            children = item
        else:
            continue
        if level > MAX_DEPTH:
            raise BodyError(f"The JSON is nested more than {MAX_DEPTH} levels deep.")
        stack.extend((child, level + 1) for child in children)
