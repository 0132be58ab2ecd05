"""The gunicorn worker class: uvicorn's, sharing incoming connections between workers.

All workers listen on one socket. Left to itself, the event loop accepts every
pending connection in one go, so a burst (a client opening its pool, a load
balancer reconnecting) lands on whichever worker woke first while the others
idle, and keep-alive connections then stay there for good.

Here the workers publish how many connections each holds in a small table of
shared memory (created by the gunicorn master, inherited by every worker it
forks). A worker that holds more than the least busy one lets a new
connection wait for that one, briefly (`YIELD_SECONDS`, at most `MAX_YIELDS`
times in a row, after which it takes the connection itself: the other worker
may be stuck on something long). Requests on open connections are never held
up; only the accept of a new connection by a busier worker is.
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import logging
import math
import multiprocessing
import os
import signal
import socket
import sys
from collections.abc import Iterable
from typing import Any, cast

from gunicorn.arbiter import Arbiter
from uvicorn.config import Config
from uvicorn.server import Server
from uvicorn_worker import UvicornWorker

from fastpubsub.api import siblings
from fastpubsub.api.wakeups import begin_stopping_everywhere
from fastpubsub.settings import get_settings

logger = logging.getLogger("fastpubsub.server")

PR_SET_PDEATHSIG = 1  # prctl(2)

YIELD_SECONDS = 0.002
# At shutdown, how long streams, long-polls and WebSockets get to end on their own first.
STOPPING_SECONDS = 0.05
MAX_YIELDS = 5
SLOTS = 128  # workers beyond this many accept freely

# Collector thresholds for a serving worker (Python's defaults: 700, 10, 10).
GC_THRESHOLDS = (7000, 10, 100)

# One slot per worker: its pid and how many connections it holds. Created when
# the master imports this module, before it forks any worker.
_pids = multiprocessing.RawArray(ctypes.c_int, SLOTS)
_loads = multiprocessing.RawArray(ctypes.c_int, SLOTS)
_claim = multiprocessing.Lock()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def claim_slot() -> int | None:
    """Take a free slot (or one whose worker has died) for this process."""
    me = os.getpid()
    with _claim:
        for slot in range(SLOTS):
            pid = _pids[slot]
            if pid == 0 or pid == me or not _alive(pid):
                _pids[slot] = me
                _loads[slot] = 0
                return slot
    return None


def release_slot(slot: int | None) -> None:
    if slot is not None:
        with _claim:
            if _pids[slot] == os.getpid():
                _pids[slot] = 0
                _loads[slot] = 0


def other_workers() -> list[int]:
    """The pids of the other workers serving now (those that have claimed a slot)."""
    me = os.getpid()
    # One copy of the array (a slice is a single C call): reading 128 shared
    # ints one at a time took three times as long, on every wake-up sent.
    return [pid for pid in _pids[:] if pid and pid != me]


def least_busy_elsewhere(slot: int) -> int | None:
    """The fewest connections any other live worker holds (None when there is none)."""
    fewest: int | None = None
    for other in range(SLOTS):
        pid = _pids[other]
        if other == slot or pid == 0:
            continue
        load = _loads[other]
        if (fewest is None or load < fewest) and _alive(pid):
            fewest = load
    return fewest


def tune_garbage_collector() -> None:
    """Keep the cyclic garbage collector from pausing a worker that holds many connections.

    A full collection walks every tracked object, and Python runs one whenever
    the objects that survived young collections have grown by a quarter: a
    worker taking on thousands of streams (clients reconnecting after a
    deploy) then ran a full collection every few hundred new connections, each
    longer than the one before, up to seconds with 5,000 streams, during which
    it answered nothing. Here everything alive once the application has started
    (modules, settings, pools) is moved out of the collector's sight
    (`gc.freeze`), and young collections run ten times less often, so that a
    full one comes at most every ~7 million net allocations (at most once while
    10,000 streams open) instead of at every quarter's growth. Garbage without
    cycles is freed at once as always; cyclic garbage waits a little longer.
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


class CoalescedWrites:
    """A connection's transport whose writes in one turn of the event loop leave together at its end.

    uvicorn writes a response's status line and headers when the application
    starts it, and its body when the application sends that: two sends for
    every response. On loopback, where most of this server's clients and
    proxies are, a send also wakes the client, which may then take the CPU
    from this worker in the middle of its turn. Collected here and sent once
    the turn's callbacks have run, a response costs one send, and the
    clients a turn answers are woken after its work is done, not during it:
    the HTTP floor rose by 13-17% (README, Performance); sending a
    response's start with its body at once, during the turn, halved the
    sends too but gained nothing measurable. A write waits at most for the
    rest of its turn. Closing sends what is pending first; aborting drops it,
    as the transport would; what is pending when the connection has gone is
    dropped.
    """

    __slots__ = ("_loop", "_pending", "_transport")

    def __init__(self, transport: asyncio.BaseTransport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = cast(asyncio.WriteTransport, transport)  # a connection's: it writes
        self._loop = loop
        self._pending: list[bytes] = []

    def write(self, data: bytes) -> None:
        if not self._pending:
            self._loop.call_soon(self.flush)
        self._pending.append(bytes(data))

    def writelines(self, lines: Iterable[bytes]) -> None:
        for data in lines:
            self.write(data)

    def flush(self) -> None:
        if self._pending:
            data = b"".join(self._pending)
            self._pending.clear()
            if not self._transport.is_closing():
                self._transport.write(data)

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + sum(map(len, self._pending))

    def write_eof(self) -> None:
        self.flush()
        self._transport.write_eof()

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def abort(self) -> None:
        self._pending.clear()
        self._transport.abort()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class SharingServer(Server):
    """A uvicorn server that accepts connections itself, one at a time, sharing them out."""

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self._listeners: list[socket.socket] = []
        self._rearm: dict[int, asyncio.TimerHandle] = {}
        self._yields: dict[int, int] = {}
        self._starting: set[asyncio.Task[object]] = set()
        self._slot: int | None = None
        self._parent = os.getppid()

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        # Run uvicorn's start-up (lifespan, state) without letting it create servers.
        await super().startup(sockets=[])
        tune_garbage_collector()
        self._slot = claim_slot()
        loop = asyncio.get_running_loop()
        for listener in sockets or []:
            listener.setblocking(False)
            self._listeners.append(listener)
            loop.add_reader(listener.fileno(), self._accept_one, listener)

    async def on_tick(self, counter: int) -> bool:
        self._publish_load()  # connections also close: keep the table current
        if os.getppid() != self._parent and not self.should_exit:
            # The master is gone (killed, crashed): nobody supervises this worker
            # any more, and it holds the port a new server needs. Stop, as
            # gunicorn's own workers do.
            logger.warning("the server's main process went away: this worker stops")
            self.should_exit = True
        return await super().on_tick(counter)

    def _publish_load(self, extra: int = 0) -> int:
        load = len(self.server_state.connections) + len(self._starting) + extra
        if self._slot is not None:
            _loads[self._slot] = load
        return load

    def _protocol(self) -> asyncio.Protocol:
        protocol = self.config.http_protocol_class(  # type: ignore[call-arg]  # uvicorn's protocols take these
            config=self.config,
            server_state=self.server_state,
            app_state=self.lifespan.state,
        )
        # The protocol, and a WebSocket it hands the connection to, write through CoalescedWrites.
        made = protocol.connection_made
        loop = asyncio.get_running_loop()

        def connection_made(transport: asyncio.BaseTransport) -> None:
            made(CoalescedWrites(transport, loop))  # type: ignore[arg-type]  # it stands in for the transport

        protocol.connection_made = connection_made  # type: ignore[method-assign]
        return protocol

    def _accept_one(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        fd = listener.fileno()
        if self._slot is not None and self._yields.get(fd, 0) < MAX_YIELDS:
            fewest = least_busy_elsewhere(self._slot)
            if fewest is not None and self._publish_load() > fewest:
                self._yields[fd] = self._yields.get(fd, 0) + 1
                self._pause(listener, YIELD_SECONDS)
                return
        self._yields[fd] = 0
        try:
            connection, _ = listener.accept()
        except (BlockingIOError, InterruptedError):
            return  # another worker took it
        except OSError:
            return  # e.g. the client reset before we got to it, or too many open files
        connection.setblocking(False)
        task = loop.create_task(loop.connect_accepted_socket(self._protocol, connection, ssl=self.config.ssl))
        self._starting.add(task)
        task.add_done_callback(self._started)
        self._publish_load()
        # One connection per turn of the event loop, so the others get a look in.
        self._pause(listener, 0)

    def _pause(self, listener: socket.socket, seconds: float) -> None:
        loop = asyncio.get_running_loop()
        fd = listener.fileno()
        loop.remove_reader(fd)
        self._rearm[fd] = loop.call_later(seconds, self._resume, listener)

    def _started(self, task: asyncio.Task[object]) -> None:
        self._starting.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.debug("a connection could not be set up: %s", task.exception())

    def _resume(self, listener: socket.socket) -> None:
        self._rearm.pop(listener.fileno(), None)
        if self.should_exit:
            return
        asyncio.get_running_loop().add_reader(listener.fileno(), self._accept_one, listener)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        # Long-polls answer with what they have and streams end now, so that the
        # connections close; requests in flight get timeout_graceful_shutdown.
        begin_stopping_everywhere()
        # A few turns of the loop: WebSockets close themselves, saying the server is stopping
        # (1001), before uvicorn closes whatever is left (1012).
        await asyncio.sleep(STOPPING_SECONDS)
        loop = asyncio.get_running_loop()
        for handle in self._rearm.values():
            handle.cancel()
        self._rearm.clear()
        for listener in self._listeners:
            loop.remove_reader(listener.fileno())
        release_slot(self._slot)
        self._slot = None
        await super().shutdown(sockets=sockets)


def stop_with_parent(parent: int) -> None:
    """Have the kernel send this process SIGTERM when `parent` exits (Linux; elsewhere nothing).

    A worker polls for its master too (SharingServer.on_tick), but only once it
    serves: one still importing or starting up when the master is killed would
    otherwise finish starting, then notice. The signal reaches it at any stage:
    before the server runs, SIGTERM ends the process at once; after, it is the
    server's graceful stop.
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):  # no prctl here: on_tick still notices
        return
    if os.getppid() != parent:  # it went before the request took effect
        os.kill(os.getpid(), signal.SIGTERM)


class Worker(UvicornWorker):  # type: ignore[misc]  # uvicorn-worker has no type information
    def init_process(self) -> None:
        stop_with_parent(self.ppid)
        # The application is loaded after the fork: its wake-up hub finds its siblings here.
        if get_settings().worker_relay:
            siblings.configure(siblings.Siblings(group=str(self.ppid), me=os.getpid(), peers=other_workers))
        super().init_process()

    async def _serve(self) -> None:
        self.config.app = self.wsgi
        self.config.timeout_graceful_shutdown = math.ceil(get_settings().api_graceful_seconds)
        server = SharingServer(config=self.config)
        # The master's quick stop (SIGINT or SIGQUIT to it) sends workers SIGQUIT.
        # uvicorn-worker's own handler only marks the gunicorn worker as stopping,
        # which the uvicorn server never reads: the worker would then serve on
        # until the master kills it. Stop the server itself instead.
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGQUIT, server.handle_exit, signal.SIGQUIT, None)
        await server.serve(sockets=self.sockets)
        if not server.started:
            sys.exit(Arbiter.WORKER_BOOT_ERROR)
