"""Console forms to API bodies: text fields become the typed values the API's models check.

The API's own models (fastpubsub.api.schemas) validate the result, so a form
is held to exactly the rules a JSON request is.
"""

from __future__ import annotations

from typing import Any

import orjson

from fastpubsub.exceptions import InvalidInputError

Form = dict[str, list[str]]


def text(form: Form, name: str) -> str:
    """A field's value, stripped ("" when it was not sent)."""
    return form.get(name, [""])[0].strip()


def integer(form: Form, name: str) -> int | None:
    """An optional whole number (empty: None)."""
    value = text(form, name)
    if not value:
        return None
    try:
        return int(value)
    except ValueError as exc:
        raise InvalidInputError(f"{name} must be a whole number") from exc


def number(form: Form, name: str) -> float | None:
    value = text(form, name)
    if not value:
        return None
    try:
        return float(value)
    except ValueError as exc:
        raise InvalidInputError(f"{name} must be a number") from exc


def json_object(form: Form, name: str) -> dict[str, Any] | None:
    """An optional JSON object (empty: None)."""
    value = text(form, name)
    if not value:
        return None
    try:
        parsed = orjson.loads(value)
    except orjson.JSONDecodeError as exc:
        raise InvalidInputError(f"{name} is not valid JSON: {exc}") from exc
    if not isinstance(parsed, dict):
        raise InvalidInputError(f"{name} must be a JSON object")
    return parsed


def fields(form: Form, names: dict[str, Any]) -> dict[str, Any]:
    """The fields filled in, each read with its reader (`text`, `integer`, ...); empty ones left out."""
    values = {name: read(form, name) for name, read in names.items()}
    return {name: value for name, value in values.items() if value not in (None, "")}
