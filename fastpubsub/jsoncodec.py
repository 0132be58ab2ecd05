"""JSON in and out through orjson, without ever altering a value.

orjson is several times faster than the json module, but it handles integers
only within 64 bits: it refuses to write bigger ones (TypeError) and reads
them as floats, rounding them. JSON and PostgreSQL's jsonb have no such limit,
so values beyond it go through the json module instead, which keeps them
exact. Everything else takes the fast path.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any
from uuid import UUID

import orjson

# Any integer orjson could round has at least 19 digits (2**63 has 19).
_LONG_DIGITS = re.compile(rb"\d{19}")
_LONG_DIGITS_TEXT = re.compile(r"\d{19}")
# An escape of half a surrogate pair; a lone one, once read.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_SURROGATE_ESCAPE_TEXT = re.compile(r"\\u[dD][89a-fA-F]")
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def loads(data: bytes | bytearray | memoryview | str) -> Any:
    """Parse JSON, keeping integers of any size exact.

    Refuses (ValueError) what orjson refuses and JSON text cannot stand for:
    a lone half of a UTF-16 surrogate pair (`"\\ud800"`, which no UTF-8 text
    holds), and nesting too deep to read.
    """
    pattern = _LONG_DIGITS_TEXT if isinstance(data, str) else _LONG_DIGITS
    if pattern.search(data):  # type: ignore[arg-type]  # memoryview works as a buffer
        return _loads_exactly(data)
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        # orjson refuses a few things the json module reads (1e400, NaN): let
        # it decide, so that callers see one behaviour.
        return _loads_exactly(data)


def _loads_exactly(data: bytes | bytearray | memoryview | str) -> Any:
    """The json module's reading, with the two refusals of loads."""
    text = data if isinstance(data, str | bytes | bytearray) else bytes(data)
    try:
        value = json.loads(text)
    except RecursionError:
        raise ValueError("the JSON is nested too deeply to read") from None
    escapes = _SURROGATE_ESCAPE_TEXT if isinstance(text, str) else _SURROGATE_ESCAPE
    if escapes.search(text) and _any_scalar(value, _lone_surrogate, keys=True):  # type: ignore[arg-type]
        raise ValueError("a \\ud800-\\udfff escape must be one half of a surrogate pair")
    return value


def dumps(value: Any, option: int = 0) -> bytes:
    """Serialize like orjson.dumps(value, option=option), integers of any size included."""
    try:
        return orjson.dumps(value, option=option)
    except TypeError:
        if not _has_big_int(value):
            raise
    utc_z = bool(option & orjson.OPT_UTC_Z)
    text = json.dumps(
        value,
        ensure_ascii=False,
        separators=(",", ":"),
        allow_nan=False,
        default=lambda v: _default(v, utc_z),
    )
    return text.encode("utf-8")


def dumps_text(value: Any) -> str:
    return dumps(value).decode("utf-8")


# A JSON string (escapes included), or a character that opens, closes or separates.
_STRUCTURE = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{},]', re.DOTALL)


def array_elements(text: str) -> list[str]:
    """The elements of a JSON array, each as it was written (none read, so none altered).

    `text` must be valid JSON and an array (what PostgreSQL renders, say): the
    commas that separate its elements are found, skipping those inside
    strings, objects and nested arrays.
    """
    elements: list[str] = []
    depth = 0
    start = 0
    for token in _STRUCTURE.finditer(text):
        mark = token.group()[0]
        if mark == '"':
            continue
        if mark in "[{":
            depth += 1
            if depth == 1:
                start = token.end()
        elif mark in "]}":
            depth -= 1
            if depth == 0 and text[start : token.start()].strip():
                elements.append(text[start : token.start()].strip())
        elif depth == 1:  # a comma between two elements
            elements.append(text[start : token.start()].strip())
            start = token.end()
    return elements


# What callers that refuse non_finite values say.
FINITE_NUMBERS = (
    "numbers must be finite: NaN, Infinity and numbers out of a double's range (1e400) are refused"
)


def non_finite(value: Any) -> bool:
    """Whether a parsed JSON value holds NaN or an infinity anywhere (JSON has neither)."""
    return _any_scalar(value, lambda item: isinstance(item, float) and not math.isfinite(item))


def _lone_surrogate(item: Any) -> bool:
    return isinstance(item, str) and _LONE_SURROGATE.search(item) is not None


def _has_big_int(value: Any) -> bool:
    return _any_scalar(
        value,
        lambda item: isinstance(item, int) and not isinstance(item, bool) and not -(2**63) <= item < 2**64,
    )


def _any_scalar(value: Any, test: Callable[[Any], bool], *, keys: bool = False) -> bool:
    """Whether `test` holds for any value inside `value` that is not an object or a list
    (with `keys`, for any key of an object too)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            if keys:
                stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)
        elif test(item):
            return True
    return False


def _default(value: Any, utc_z: bool) -> Any:
    if isinstance(value, UUID):
        return str(value)
    if isinstance(value, datetime):
        text = value.isoformat()
        if utc_z and value.utcoffset() == timedelta(0):
            text = text.removesuffix("+00:00") + "Z"
        return text
    raise TypeError(f"{type(value).__name__} is not JSON serializable")
