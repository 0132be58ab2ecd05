"""Structured logging: one JSON object per line, carrying the current request id."""

from __future__ import annotations

import asyncio
import contextvars
import logging
import sys
from collections.abc import Coroutine
from datetime import UTC, datetime
from typing import Any, TypeVar

import orjson

request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("request_id", default=None)
T = TypeVar("T")

# Attributes every record has (and uvicorn's colour copy of the message): not repeated as fields.
_STANDARD_ATTRS = set(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {
    "message",
    "asctime",
    "color_message",
}


def detached(coro: Coroutine[Any, Any, T], name: str) -> asyncio.Task[T]:
    """A task that outlives the request that starts it: its log lines carry no request id."""
    context = contextvars.copy_context()
    context.run(request_id.set, None)
    return asyncio.create_task(coro, name=name, context=context)


def one_line(exc: BaseException) -> str:
    """The gist of an error on one line: the driver's first line, without SQLAlchemy's wrapping."""
    inner = getattr(exc, "orig", None)
    text = str(inner if isinstance(inner, BaseException) else exc).strip()
    first = text.splitlines()[0].strip() if text else ""
    return first or type(exc).__name__


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        rid = request_id.get()
        if rid is not None:
            entry["request_id"] = rid
        for key, value in record.__dict__.items():
            if key not in _STANDARD_ATTRS and not key.startswith("_"):
                entry[key] = value
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return orjson.dumps(entry, default=str).decode()


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        rid = request_id.get()
        prefix = f"[{rid}] " if rid else ""
        return (
            f"{self.formatTime(record)} {record.levelname:<7} {record.name}: {prefix}{super().format(record)}"
        )


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever sys.stderr is when a record comes (it may have been replaced since)."""

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stderr
        super().emit(record)


def configure_logging(level: str = "info", fmt: str = "json") -> None:
    """Route fastpubsub, uvicorn and gunicorn logs through one formatter on stderr."""
    handler = _StderrHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter("%(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", "gunicorn.error"):
        logger = logging.getLogger(name)
        logger.handlers[:] = []
        logger.propagate = True
    # Request lines are logged by fastpubsub's own middleware (at debug level on
    # success: the hot paths must not log per request at info).
    logging.getLogger("uvicorn.access").disabled = True
    logging.getLogger("gunicorn.access").disabled = True
    # Alembic names each plugin it loads, at INFO, whenever it is imported.
    logging.getLogger("alembic.runtime.plugins").setLevel(logging.WARNING)
    # httpx logs every request at INFO with its whole URL: a push-worker's, one
    # line per push, with whatever token an endpoint URL carries.
    logging.getLogger("httpx").setLevel(logging.WARNING)
