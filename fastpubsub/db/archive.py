"""The archive's ledger: batches claimed, committed and read, on one session of its own.

A run of `fastpubsub archive` holds each batch it works on with a session
advisory lock (sql/archive.sql), so the ledger keeps one plain connection open
for the whole run: when the process dies, PostgreSQL drops the connection and
the lock with it, and the next run takes the batch over. That needs a real
session: a pooler in transaction mode (pgbouncer's default) would lose the lock.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg
from psycopg.rows import namedtuple_row

from fastpubsub.db.errors import raise_translated
from fastpubsub.db.urls import libpq_url
from fastpubsub.sql.source import driver_queries


@dataclass(frozen=True)
class ArchiveBatch:
    """Messages created and deliveries acked in [starts_at, ends_at); starts_at None is -infinity."""

    id: int
    starts_at: datetime | None
    ends_at: datetime
    claims: int = 1
    files: tuple[str, ...] = ()
    messages: int = 0
    acked_deliveries: int = 0


class ArchiveLedger:
    """The archive_batches table of one database, through one session held for the whole run."""

    def __init__(self, url: str, *, application_name: str = "fastpubsub-archive") -> None:
        try:
            self._conn = psycopg.connect(
                libpq_url(url),
                autocommit=True,
                connect_timeout=5,
                application_name=application_name,
                options="-c TimeZone=UTC",
                row_factory=namedtuple_row,
            )
        except psycopg.Error as exc:
            raise_translated(exc)

    def close(self) -> None:
        self._conn.close()

    def __enter__(self) -> ArchiveLedger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _rows(self, query: str, /, **params: Any) -> list[Any]:
        try:
            cursor = self._conn.execute(driver_queries()[query], params)
            return cursor.fetchall() if cursor.description else []
        except psycopg.Error as exc:
            raise_translated(exc)

    def claim(self, destination: str, settle_seconds: int) -> ArchiveBatch | None:
        """The next batch for this session to export (held until commit or release), or None."""
        rows = self._rows("archive_claim", destination=destination, settle_seconds=settle_seconds)
        if not rows:
            return None
        row = rows[0]
        return ArchiveBatch(int(row.id), row.starts_at, row.ends_at, int(row.claims))

    def commit(self, batch: ArchiveBatch, files: list[str], messages: int, acked_deliveries: int) -> bool:
        """Record the batch as exported; False when this session no longer holds it."""
        (row,) = self._rows(
            "archive_commit",
            batch_id=batch.id,
            files=files,
            messages=messages,
            acked_deliveries=acked_deliveries,
        )
        return bool(row.committed)

    def release(self, batch: ArchiveBatch) -> None:
        """Let go of a batch without committing it: the next run takes it over at once."""
        self._rows("archive_release", batch_id=batch.id)

    def watermark(self, destination: str) -> datetime | None:
        """Everything before this time is in the archive; None when nothing is."""
        (row,) = self._rows("archive_watermark", destination=destination)
        return row.watermark  # type: ignore[no-any-return]

    def committed(self, destination: str, since: datetime) -> list[ArchiveBatch]:
        """The committed batches below the watermark that end after `since`, oldest first."""
        return [
            ArchiveBatch(
                int(row.id),
                row.starts_at,
                row.ends_at,
                files=tuple(row.files),
                messages=int(row.messages),
                acked_deliveries=int(row.acked_deliveries),
            )
            for row in self._rows("archive_committed", destination=destination, since=since)
        ]
