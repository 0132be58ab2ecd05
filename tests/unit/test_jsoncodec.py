"""JSON through orjson without altering values: integers beyond 64 bits stay exact."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime

import orjson
import pytest

from fastpubsub import jsoncodec

BIG = [2**64, 2**64 - 1, -(2**63), -(2**63) - 1, 10**40, -(10**40)]


@pytest.mark.parametrize("number", BIG)
def test_loads_keeps_integers_exact(number: int) -> None:
    text = json.dumps({"n": number, "list": [number, 1.5, "12345678901234567890"]})
    parsed = jsoncodec.loads(text.encode())
    assert parsed == {"n": number, "list": [number, 1.5, "12345678901234567890"]}
    assert type(parsed["n"]) is int
    assert jsoncodec.loads(memoryview(text.encode())) == parsed
    assert jsoncodec.loads(text) == parsed


@pytest.mark.parametrize("number", BIG)
def test_dumps_writes_integers_exactly(number: int) -> None:
    assert json.loads(jsoncodec.dumps({"n": [number, {"m": number}]})) == {"n": [number, {"m": number}]}


def test_dumps_matches_orjson_for_messages() -> None:
    when = datetime(2026, 1, 2, 3, 4, 5, 123456, tzinfo=UTC)
    message_id = uuid.uuid4()
    small = {"id": message_id, "created_at": when, "payload": {"n": 1, "s": "ünï"}}
    assert jsoncodec.dumps(small, orjson.OPT_UTC_Z) == orjson.dumps(small, option=orjson.OPT_UTC_Z)
    big = {**small, "payload": {"n": 2**64, "s": "ünï"}}
    assert jsoncodec.dumps(big, orjson.OPT_UTC_Z) == orjson.dumps(small, option=orjson.OPT_UTC_Z).replace(
        b'"n":1', b'"n":18446744073709551616'
    )


def test_dumps_still_refuses_what_is_not_json() -> None:
    with pytest.raises(TypeError):
        jsoncodec.dumps({"x": object()})
    with pytest.raises(TypeError):
        jsoncodec.dumps({"x": object(), "n": 2**64})


def test_non_finite() -> None:
    assert not jsoncodec.non_finite({"a": [1, 2.5, {"b": None}], "c": 2**70})
    for bad in (float("nan"), float("inf"), float("-inf")):
        assert jsoncodec.non_finite({"a": [1, {"b": [bad]}]})


@pytest.mark.parametrize(
    "text",
    [
        '{"a": "\\ud800"}',
        '{"a": ["x", "\\udfff y"]}',
        '{"\\udc00": 1}',
        '{"n": 12345678901234567890, "a": "\\ud800"}',  # the path for long integers too
    ],
)
def test_loads_refuses_half_a_surrogate_pair(text: str) -> None:
    with pytest.raises(ValueError, match="surrogate pair"):
        jsoncodec.loads(text)
    with pytest.raises(ValueError, match="surrogate pair"):
        jsoncodec.loads(text.encode())


def test_loads_reads_whole_surrogate_pairs_and_refuses_json_nested_too_deep() -> None:
    assert jsoncodec.loads('{"a": "\\ud83d\\ude00", "n": 1e400}') == {"a": "\U0001f600", "n": float("inf")}
    deep = "[" * 3000 + "]" * 3000
    with pytest.raises(ValueError, match="nested too deeply"):
        jsoncodec.loads(deep)


@pytest.mark.parametrize(
    ("text", "elements"),
    [
        ("[]", []),
        (" [ ] ", []),
        ('[{"a": 1}]', ['{"a": 1}']),
        (
            '[{"s": "a, b ] } { [", "q": "say \\"hi\\", \\\\"}, {"n": [1, [2, 3]], "o": {"x": {}}}]',
            ['{"s": "a, b ] } { [", "q": "say \\"hi\\", \\\\"}', '{"n": [1, [2, 3]], "o": {"x": {}}}'],
        ),
        (
            "[1, 123456789012345678901234567890, 0.1234567890123456789012]",
            ["1", "123456789012345678901234567890", "0.1234567890123456789012"],
        ),
        ('["\\u00e9,", null, true]', ['"\\u00e9,"', "null", "true"]),
    ],
)
def test_array_elements_are_split_as_written(text: str, elements: list[str]) -> None:
    assert jsoncodec.array_elements(text) == elements
    assert [json.loads(e) for e in elements] == json.loads(text)  # each a value of the array, in order
