"""News between the worker processes of one server, without a round trip through PostgreSQL.

The workers of a server (gunicorn forks them from one master process) tell
each other what they tell every process on the notification channel (see
api/wakeups.py), and sooner: each worker binds a datagram socket in Linux's
abstract namespace, named after its master and itself, and a notification's
payload goes to the other workers' sockets just before it goes to
PostgreSQL. A sibling then wakes its consumers about a millisecond earlier
than LISTEN would let it (the notifying transaction's round trip and the
relay through the database), and ignores the notification when it arrives
(wakeups._Echoes). When only siblings wait for the news, no notification is
sent at all. Processes elsewhere (other servers, push workers) hear
notifications as before.

Only a datagram the kernel took counts: a sibling that is gone, or whose
queue is full, is told by notification instead (WakeHub._send), and so is
every sibling while this worker stops (they drop its datagrams once it has
left the list of workers, while its last requests may still publish). Outside
Linux, or when the socket cannot be made or bound, the workers simply do
without.

Abstract sockets have no file permissions: any process on the host (in the
same network namespace) may send to one. A datagram counts only when it
comes from a sibling's own socket, bound to its name (which no other process
can bind while the sibling lives): one sent from anywhere else is dropped
unread (the datagrams carry messages leased for a consumer, see
wakeups.HANDED).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from fastpubsub.logs import one_line

log = logging.getLogger(__name__)

# How many datagrams one turn of the event loop reads before letting others run.
MAX_READ_PER_TURN = 64
MAX_DATAGRAM_BYTES = 65536


@dataclass(frozen=True)
class Siblings:
    """Who this process is among the workers of one server."""

    group: str  # the same for every worker of the server (its master's pid)
    me: int  # this worker (its pid)
    peers: Callable[[], Iterable[int]]  # the other workers, as they are now


_configured: Siblings | None = None


def configure(siblings: Siblings | None) -> None:
    """This process is a worker among siblings (api/worker.py, after the fork); None: it is not."""
    global _configured
    _configured = siblings


def configured() -> Siblings | None:
    return _configured


def address(group: str, member: int) -> str:
    """A worker's socket name (the leading NUL puts it in the abstract namespace: no file to clean up)."""
    return f"\0fastpubsub-{group}-{member}"


class SiblingRelay:
    """This worker's socket: sends a payload to every sibling, hands each one received to `on_payload`."""

    def __init__(self, siblings: Siblings, on_payload: Callable[[str], None]) -> None:
        self.siblings = siblings
        self.on_payload = on_payload
        self._socket: socket.socket | None = None
        # Counted for the tests: datagrams delivered to a sibling's queue, and refused.
        self.sent = 0
        self.missed = 0
        self.refused = 0  # datagrams from a socket that is not a sibling's, dropped

    @classmethod
    def open(cls, siblings: Siblings, on_payload: Callable[[str], None]) -> SiblingRelay | None:
        """Bound and reading on the running loop; None where that is impossible (then notifications do)."""
        if not sys.platform.startswith("linux"):
            return None
        relay = cls(siblings, on_payload)
        sock: socket.socket | None = None
        try:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            sock.setblocking(False)
            sock.bind(address(siblings.group, siblings.me))
        except OSError as exc:  # the name is taken, no file descriptors left, ...
            if sock is not None:
                sock.close()
            log.warning(
                "workers will hear of each other's messages through PostgreSQL only: %s", one_line(exc)
            )
            return None
        relay._socket = sock
        asyncio.get_running_loop().add_reader(sock.fileno(), relay._readable)
        return relay

    def send(self, payload: str) -> set[int]:
        """Put `payload` in every sibling's queue now; those that took it."""
        reached: set[int] = set()
        if self._socket is None:
            return reached
        data = payload.encode()
        for peer in self.siblings.peers():
            if peer == self.siblings.me:
                continue
            try:
                self._socket.sendto(data, address(self.siblings.group, peer))
            except OSError:  # gone (nobody bound), or its queue is full: it will hear the notification
                self.missed += 1
                continue
            reached.add(peer)
        self.sent += len(reached)
        return reached

    def send_to(self, peer: int, payload: str) -> bool:
        """Put `payload` in one sibling's queue now; whether it took it."""
        if self._socket is None or peer == self.siblings.me:
            return False
        try:
            self._socket.sendto(payload.encode(), address(self.siblings.group, peer))
        except OSError:  # gone, or its queue is full
            self.missed += 1
            return False
        self.sent += 1
        return True

    def _readable(self) -> None:
        assert self._socket is not None
        for _ in range(MAX_READ_PER_TURN):
            try:
                data, sender = self._socket.recvfrom(MAX_DATAGRAM_BYTES)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                log.debug("reading a sibling's datagram: %s", one_line(exc))
                return
            if not self._from_sibling(sender):
                self.refused += 1
                if self.refused == 1 or self.refused % 1000 == 0:
                    log.warning("dropped %d datagrams not sent by a worker of this server", self.refused)
                continue
            try:
                self.on_payload(data.decode())
            except Exception:  # one bad payload must not stop the others
                log.exception("acting on a sibling's news")

    def _from_sibling(self, sender: object) -> bool:
        """Whether `sender` (recvfrom's address) is the socket of a current sibling."""
        if isinstance(sender, bytes):
            sender = sender.decode(errors="replace")
        if not isinstance(sender, str):
            return False
        group, me = self.siblings.group, self.siblings.me
        return any(sender == address(group, peer) for peer in self.siblings.peers() if peer != me)

    def close(self) -> None:
        if self._socket is not None:
            asyncio.get_running_loop().remove_reader(self._socket.fileno())
            self._socket.close()
            self._socket = None
