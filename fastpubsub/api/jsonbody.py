"""Publish bodies, checked without holding up the event loop: nesting depth, message sizes, envelopes.

A publish body may be 10 MB. Parsing that much JSON in Python is one C call
that holds the event loop (and the GIL, so a thread would not help) for up to
seconds, and it was done only to check each message's size. Instead:

* the nesting depth is checked with a few byte-string operations that run at
  C speed (counting brackets, then taking away strings and empty pairs): a
  small publish pays microseconds, and only a body they cannot settle is
  scanned token by token;
* that scan, and the one that finds where each message of a large body
  starts and ends, hand the event loop back every SLICE_TOKENS tokens;
* envelopes of a large body are parsed and validated one message at a time,
  with the same pause between slices.

The seed body (an array of payloads) then goes to PostgreSQL as it came;
PostgreSQL checks the rest.
"""

from __future__ import annotations

import asyncio
import re
from array import array
from collections.abc import Sequence
from typing import Any

from fastapi.exceptions import RequestValidationError
from pydantic import TypeAdapter, ValidationError

from fastpubsub import jsoncodec
from fastpubsub.api.schemas import MAX_JSON_DEPTH, PublishMessage, PublishRequest
from fastpubsub.exceptions import InvalidInputError, PayloadTooLargeError

# Tokens the scan handles between two pauses (about a millisecond and a half of work).
SLICE_TOKENS = 4_000
# Envelope bodies up to this size are validated in one go (a few milliseconds at most).
SMALL_BODY_BYTES = 64 * 1024
# Levels a body adds above a message's payload: [payload] and {"messages": [{"payload": ...}]}.
SEED_LEVELS = 1
ENVELOPE_LEVELS = 3

# A string (escapes included) or one structural character.
_TOKEN = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{},]')
_BRACKETS_AND_QUOTES = b'"[]{}'
_OTHER_BYTES = bytes(sorted(set(range(256)) - set(_BRACKETS_AND_QUOTES)))
_EMPTY_PAIR = re.compile(rb"\[\]|\{\}")
_QUICK_LIMIT_BYTES = 1024 * 1024
# Each pass over the brackets is one C call: past this many, the (pausing) scan decides instead.
_QUICK_LIMIT_BRACKETS = 16 * 1024
_ENVELOPE_HEAD = re.compile(rb'\s*\{\s*"messages"\s*:\s*(?=\[)')
_ENVELOPE_TAIL = re.compile(rb"\}\s*\Z")
_MESSAGE = TypeAdapter(PublishMessage)


def too_deep() -> InvalidInputError:
    return InvalidInputError(
        f"JSON nested more than {MAX_JSON_DEPTH} levels deep: a message's payload may nest objects and "
        f"arrays at most {MAX_JSON_DEPTH} levels (the payload itself is the first); nothing was published"
    )


def depth_within(body: bytes, limit: int) -> bool | None:
    """Whether `body` nests at most `limit` levels, when byte operations can tell (None: scan it).

    Strings are taken away (after escaped backslashes and quotes), leaving the
    brackets; each pass then takes away the innermost empty pairs, one level.
    """
    if body.count(b"[") + body.count(b"{") <= limit:
        return True
    if len(body) > _QUICK_LIMIT_BYTES:
        return None
    if b"\\" in body:
        # Backslashes pair up from the left inside a string: `\\` first, then `\"`.
        body = body.replace(b"\\\\", b"").replace(b'\\"', b"")
    brackets = body.translate(None, _OTHER_BYTES).replace(b'""', b"")
    if b'"' in brackets or len(brackets) > _QUICK_LIMIT_BRACKETS:
        return None  # a string holding brackets, or too many brackets for passes that never pause
    for _ in range(limit):
        if not brackets:
            return True
        brackets = _EMPTY_PAIR.sub(b"", brackets)
    return True if not brackets else None


async def scan(body: bytes, limit: int) -> list[tuple[int, int]]:
    """Check the depth token by token; return where each element of the outermost array starts and ends.

    Raises InvalidInputError past `limit` levels. A body that is not JSON gets
    some answer here and is refused by whoever parses it.
    """
    bounds = await _scan(body, limit)
    return list(zip(bounds[::2], bounds[1::2], strict=True))


async def _scan(body: bytes, limit: int) -> array[int]:
    """The element bounds as one flat array (start, end, start, end, ...).

    Integers in an array, not a tuple per element: tens of thousands of small
    objects would make the garbage collector walk them, in pauses of tens of
    milliseconds.
    """
    depth = 0
    items = array("q")
    start = 0
    for count, token in enumerate(_TOKEN.finditer(body), 1):
        if count % SLICE_TOKENS == 0:
            await asyncio.sleep(0)
        char = body[token.start()]
        if char in b"[{":
            depth += 1
            if depth > limit:
                raise too_deep()
            if depth == 1:
                start = token.end()
        elif char in b"]}":
            if depth == 1 and char == ord("]") and body[start : token.start()].strip():
                items.extend((start, token.start()))
            depth -= 1
        elif char == ord(",") and depth == 1:
            items.extend((start, token.start()))
            start = token.end()
    return items


async def check_depth(body: bytes, levels_above: int) -> None:
    """Refuse a publish body whose messages nest deeper than MAX_JSON_DEPTH."""
    if not depth_within(body, MAX_JSON_DEPTH + levels_above):
        await scan(body, MAX_JSON_DEPTH + levels_above)


async def check_seed_body(body: bytes, max_message_bytes: int) -> None:
    """Depth, and (when the body could hold one) no message over the limit, its JSON text as sent."""
    if len(body) <= max_message_bytes:
        await check_depth(body, SEED_LEVELS)
        return
    bounds = await _scan(body, MAX_JSON_DEPTH + SEED_LEVELS)
    for index in range(len(bounds) // 2):
        start, end = bounds[2 * index], bounds[2 * index + 1]
        if end - start <= max_message_bytes:  # the usual case, decided without copying the message
            continue
        size = len(body[start:end].strip())
        if size > max_message_bytes:
            raise PayloadTooLargeError(
                f"message at index {index} is {size} bytes, above the limit of {max_message_bytes}; "
                "nothing was published"
            )


def _problems(exc: ValidationError, *where: str | int) -> RequestValidationError:
    return RequestValidationError(
        [
            {"loc": ("body", *where, *error["loc"]), "msg": error["msg"], "type": error["type"]}
            for error in exc.errors(include_url=False)
        ]
    )


async def parse_envelopes(body: bytes) -> list[PublishMessage]:
    """The messages of an envelope publish, validated; RequestValidationError (422) when invalid."""
    await check_depth(body, ENVELOPE_LEVELS)
    head = _ENVELOPE_HEAD.match(body)
    tail = _ENVELOPE_TAIL.search(body)
    if len(body) <= SMALL_BODY_BYTES or head is None or tail is None:
        if len(body) > SMALL_BODY_BYTES:
            raise InvalidInputError('a publish body over 64 KiB must be {"messages": [...]} and nothing else')
        try:
            return PublishRequest.model_validate_json(body or b"null").messages
        except ValidationError as exc:
            raise _problems(exc) from exc
    array = body[head.end() : tail.start()]
    spans = await scan(array, MAX_JSON_DEPTH + ENVELOPE_LEVELS - 1)
    if not spans:
        raise InvalidInputError("messages must hold at least one message")
    messages = []
    done = 0
    for index, (start, end) in enumerate(spans):
        try:
            messages.append(_MESSAGE.validate_json(array[start:end]))
        except ValidationError as exc:
            raise _problems(exc, "messages", index) from exc
        done += end - start
        if done >= SMALL_BODY_BYTES:
            done = 0
            await asyncio.sleep(0)
    return messages


async def envelopes_json(messages: Sequence[PublishMessage], max_message_bytes: int) -> str:
    """The envelopes as the JSON array publish_envelopes takes, refusing any message over the limit.

    A message's size is its payload and attributes, serialised compactly.
    Serialised one by one, with pauses, rather than in one call.
    """
    parts = []
    done = 0
    for index, message in enumerate(messages):
        envelope: dict[str, Any] = message.model_dump(mode="json", exclude_none=True)
        payload = jsoncodec.dumps(envelope["payload"])
        attributes = envelope.get("attributes")
        size = len(payload) + (len(jsoncodec.dumps(attributes)) if attributes else 0)
        if size > max_message_bytes:
            raise PayloadTooLargeError(
                f"message at index {index} is {size} bytes, above the limit of {max_message_bytes}; "
                "nothing was published"
            )
        part = jsoncodec.dumps(envelope)
        parts.append(part)
        done += len(part)
        if done >= SMALL_BODY_BYTES:
            done = 0
            await asyncio.sleep(0)
    return "[" + b",".join(parts).decode() + "]"
