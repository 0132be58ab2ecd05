"""Client: the AsyncClient's calls for code that does not use asyncio.

A Client runs an event loop in a thread of its own and each call runs the
AsyncClient method of the same name there, so the two behave alike (one
implementation) and a Client may be used from many threads at once (a
Subscriber's callbacks, for instance). The Publisher and Subscriber built on
a Client do their batching and lease keeping on that loop too.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import threading
from collections.abc import Callable, Coroutine
from typing import Any, Concatenate, Generic, ParamSpec, Self, TypeVar, Unpack, overload

from fastpubsub.client.aio import AsyncClient, ClientOptions
from fastpubsub.client.closing import Closing

P = ParamSpec("P")
T = TypeVar("T")


class LoopThread:
    """An event loop running in a daemon thread, for blocking code to hand coroutines to."""

    def __init__(self, name: str = "fastpubsub-client") -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Start `coro` on the loop; its future."""
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError(
                "a blocking Client call from its own event loop would wait forever: "
                "use AsyncClient in async code"
            )
        if self.loop.is_closed() or not self._thread.is_alive():
            coro.close()
            raise RuntimeError("the client is closed: make a new Client")
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run `coro` on the loop and wait for its result."""
        return self.submit(coro).result()

    def call_soon(self, callback: Callable[..., object], *args: Any) -> None:
        """Call `callback(*args)` on the loop, from any thread."""
        self.loop.call_soon_threadsafe(callback, *args)

    def stop(self) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()


class blocking(Generic[P, T]):
    """A Client method: the AsyncClient method it names, run on the Client's loop until done."""

    def __init__(self, method: Callable[Concatenate[AsyncClient, P], Coroutine[Any, Any, T]]) -> None:
        self.method = method
        self.__doc__ = method.__doc__

    @overload
    def __get__(self, client: None, owner: type[Client]) -> Self: ...

    @overload
    def __get__(self, client: Client, owner: type[Client]) -> Callable[P, T]: ...

    def __get__(self, client: Client | None, owner: type[Client]) -> Self | Callable[P, T]:
        if client is None:
            return self
        method = self.method

        @functools.wraps(method)
        def call(*args: P.args, **kwargs: P.kwargs) -> T:
            return client.loop.run(method(client.aio, *args, **kwargs))

        return call


class Client(Closing):
    """A fastpubsub server over HTTP, from blocking code: the same arguments and calls as AsyncClient."""

    def __init__(self, url: str, **options: Unpack[ClientOptions]) -> None:
        self.loop = LoopThread()
        self.aio = AsyncClient(url, **options)

    @property
    def url(self) -> str:
        return self.aio.url

    @property
    def consumer_id(self) -> str:
        return self.aio.consumer_id

    def close(self) -> None:
        """Close the connections and stop the client's thread."""
        if not self.loop.loop.is_closed():
            self.loop.run(self.aio.aclose())
            self.loop.stop()

    access_token = blocking(AsyncClient.access_token)
    create_topic = blocking(AsyncClient.create_topic)
    list_topics = blocking(AsyncClient.list_topics)
    get_topic = blocking(AsyncClient.get_topic)
    update_topic = blocking(AsyncClient.update_topic)
    topic_stats = blocking(AsyncClient.topic_stats)
    delete_topic = blocking(AsyncClient.delete_topic)
    publish = blocking(AsyncClient.publish)
    publish_batch = blocking(AsyncClient.publish_batch)
    create_subscription = blocking(AsyncClient.create_subscription)
    list_subscriptions = blocking(AsyncClient.list_subscriptions)
    get_subscription = blocking(AsyncClient.get_subscription)
    update_subscription = blocking(AsyncClient.update_subscription)
    rotate_push_secret = blocking(AsyncClient.rotate_push_secret)
    delete_subscription = blocking(AsyncClient.delete_subscription)
    seek = blocking(AsyncClient.seek)
    metrics = blocking(AsyncClient.metrics)
    peek = blocking(AsyncClient.peek)
    pull = blocking(AsyncClient.pull)
    ack = blocking(AsyncClient.ack)
    nack = blocking(AsyncClient.nack)
    extend_leases = blocking(AsyncClient.extend_leases)
    ack_receipts = blocking(AsyncClient.ack_receipts)
    nack_receipts = blocking(AsyncClient.nack_receipts)
    extend_receipts = blocking(AsyncClient.extend_receipts)
    list_dlq = blocking(AsyncClient.list_dlq)
    reprocess_dlq = blocking(AsyncClient.reprocess_dlq)
    create_client = blocking(AsyncClient.create_client)
    list_clients = blocking(AsyncClient.list_clients)
    get_client = blocking(AsyncClient.get_client)
    update_client = blocking(AsyncClient.update_client)
    rotate_client_secret = blocking(AsyncClient.rotate_client_secret)
    delete_client = blocking(AsyncClient.delete_client)
