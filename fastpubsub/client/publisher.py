"""Publisher and AsyncPublisher: publish() returns at once; messages go out in batches.

Messages for one topic are sent in the order publish() was called, one
request at a time: a batch leaves when it holds `max_messages` messages or
`max_bytes` bytes, when the first message in it has waited `max_latency`
seconds, or as soon as the previous request of its topic is answered (so under
load batches fill while a request is out, and with little traffic a message
waits at most `max_latency`). Topics are sent side by side. A batch is one
request, stored all or none; when it fails, each of its messages' futures
gets the error. A batch is retried on 503 and lost answers only when all its
messages carry an idempotency key.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
from collections import deque
from dataclasses import dataclass
from typing import Any, Protocol, Unpack
from uuid import UUID

from fastpubsub.client.aio import AsyncClient, PublishOptions, encode, envelope
from fastpubsub.client.closing import AsyncClosing, Closing
from fastpubsub.client.sync import Client


@dataclass(frozen=True)
class Batching:
    """When a batch leaves. max_messages=1 turns batching off (one request per message)."""

    max_messages: int = 100
    max_bytes: int = 1_000_000
    max_latency: float = 0.01

    def __post_init__(self) -> None:
        if self.max_messages < 1 or self.max_bytes < 1 or self.max_latency < 0:
            raise ValueError("max_messages and max_bytes must be positive and max_latency not negative")


@dataclass
class PublisherStats:
    """What a publisher has sent so far."""

    requests: int = 0
    published: int = 0
    failed: int = 0


class _Outcome(Protocol):
    """What both kinds of future offer: concurrent.futures.Future and asyncio.Future."""

    def done(self) -> bool: ...
    def set_result(self, result: UUID, /) -> None: ...
    def set_exception(self, exception: BaseException, /) -> None: ...


@dataclass
class _Pending:
    body: bytes
    keyed: bool
    outcome: _Outcome


class _TopicQueue:
    """The messages of one topic waiting to be sent, and the one task sending them in order."""

    def __init__(self, client: AsyncClient, topic_id: str, batching: Batching, stats: PublisherStats) -> None:
        self.client = client
        self.topic_id = topic_id
        self.batching = batching
        self.stats = stats
        self.pending: deque[_Pending] = deque()
        self.pending_bytes = 0
        self.sender: asyncio.Task[None] | None = None
        self.linger: asyncio.TimerHandle | None = None

    def add(self, item: _Pending) -> None:
        self.pending.append(item)
        self.pending_bytes += len(item.body)
        if self.sender is not None:
            return  # it takes this message with the next batch
        batching = self.batching
        full = len(self.pending) >= batching.max_messages or self.pending_bytes >= batching.max_bytes
        if full or batching.max_latency == 0:
            self.send()
        elif self.linger is None:
            self.linger = asyncio.get_running_loop().call_later(batching.max_latency, self.send)

    def send(self) -> asyncio.Task[None] | None:
        """Start sending now, unless already sending; the sending task (None: nothing to send)."""
        if self.linger is not None:
            self.linger.cancel()
            self.linger = None
        if self.sender is None and self.pending:
            self.sender = asyncio.get_running_loop().create_task(self._send_all())
        return self.sender

    def _take(self) -> list[_Pending]:
        batch = [self.pending.popleft()]
        size = len(batch[0].body)
        while (
            self.pending
            and len(batch) < self.batching.max_messages
            and size + len(self.pending[0].body) <= self.batching.max_bytes
        ):
            batch.append(self.pending.popleft())
            size += len(batch[-1].body)
        self.pending_bytes -= size
        return batch

    async def _send_all(self) -> None:
        try:
            while self.pending:
                batch = self._take()
                body = b'{"messages":[' + b",".join(item.body for item in batch) + b"]}"
                self.stats.requests += 1
                try:
                    ids = await self.client.publish_encoded(
                        self.topic_id, body, idempotent=all(item.keyed for item in batch)
                    )
                    if len(ids) != len(batch):
                        raise RuntimeError(f"the server returned {len(ids)} ids for {len(batch)} messages")
                except Exception as exc:
                    self.stats.failed += len(batch)
                    for item in batch:
                        _resolve(item.outcome, exc)
                    continue
                self.stats.published += len(batch)
                for item, message_id in zip(batch, ids, strict=True):
                    _resolve(item.outcome, message_id)
        finally:
            self.sender = None


def _resolve(outcome: _Outcome, result: UUID | BaseException) -> None:
    """Give a future its result, unless its owner cancelled it meanwhile."""
    with contextlib.suppress(asyncio.InvalidStateError, concurrent.futures.InvalidStateError):
        if isinstance(result, BaseException):
            outcome.set_exception(result)
        else:
            outcome.set_result(result)


class _Batches:
    """Every topic's queue; lives on one event loop."""

    def __init__(self, client: AsyncClient, batching: Batching) -> None:
        self.client = client
        self.batching = batching
        self.stats = PublisherStats()
        self.topics: dict[str, _TopicQueue] = {}

    def add(self, topic_id: str, item: _Pending) -> None:
        queue = self.topics.get(topic_id)
        if queue is None:
            queue = self.topics[topic_id] = _TopicQueue(self.client, topic_id, self.batching, self.stats)
        queue.add(item)

    async def flush(self) -> None:
        """Send everything added so far, now, and wait until it is answered."""
        while senders := [task for queue in self.topics.values() if (task := queue.send()) is not None]:
            await asyncio.gather(*senders)


def _prepare(payload: Any, options: PublishOptions) -> tuple[bytes, bool]:
    message = envelope(payload, **options)
    return encode(message), message.idempotency_key is not None


class Publisher(Closing):
    """Batching publisher for blocking code; its work runs on the Client's event loop.

    `publish` checks the message, queues it and returns a
    concurrent.futures.Future of its id at once. `flush` waits for everything
    queued; closing (or leaving the `with` block) flushes too.
    """

    def __init__(self, client: Client, batching: Batching | None = None) -> None:
        self.client = client
        self._batches = _Batches(client.aio, batching or Batching())
        self.stats = self._batches.stats
        self._closed = False

    def publish(
        self, topic_id: str, payload: Any, **options: Unpack[PublishOptions]
    ) -> concurrent.futures.Future[UUID]:
        """Queue a message (a JSON object) for `topic_id`; the future of its id."""
        if self._closed:
            raise RuntimeError("the publisher is closed")
        body, keyed = _prepare(payload, options)
        future: concurrent.futures.Future[UUID] = concurrent.futures.Future()
        self.client.loop.call_soon(self._batches.add, topic_id, _Pending(body, keyed, future))
        return future

    def flush(self) -> None:
        """Send what is queued and wait until the server has answered for all of it."""
        self.client.loop.run(self._batches.flush())

    def close(self) -> None:
        """Flush, then refuse further messages."""
        self._closed = True
        self.flush()


class AsyncPublisher(AsyncClosing):
    """Batching publisher for async code: `publish` returns an awaitable of the message id."""

    def __init__(self, client: AsyncClient, batching: Batching | None = None) -> None:
        self.client = client
        self._batches = _Batches(client, batching or Batching())
        self.stats = self._batches.stats
        self._closed = False

    def publish(self, topic_id: str, payload: Any, **options: Unpack[PublishOptions]) -> asyncio.Future[UUID]:
        """Queue a message (a JSON object) for `topic_id`; await the result for its id."""
        if self._closed:
            raise RuntimeError("the publisher is closed")
        body, keyed = _prepare(payload, options)
        future: asyncio.Future[UUID] = asyncio.get_running_loop().create_future()
        self._batches.add(topic_id, _Pending(body, keyed, future))
        return future

    async def flush(self) -> None:
        """Send what is queued and wait until the server has answered for all of it."""
        await self._batches.flush()

    async def aclose(self) -> None:
        """Flush, then refuse further messages."""
        self._closed = True
        await self.flush()
