"""Workers of one server hand each other news over datagram sockets; each copy is acted on once."""

from __future__ import annotations

import asyncio
import secrets
import sys
from collections.abc import AsyncIterator, Callable

import pytest

from fastpubsub.api.siblings import SiblingRelay, Siblings
from fastpubsub.api.wakeups import MAX_ECHO_SENDERS, MAX_ECHOES, _Echoes

# Abstract-namespace sockets are Linux's (elsewhere the relay is off and notifications do it all).
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")

Opener = Callable[[int, list[int]], SiblingRelay]


@pytest.fixture
async def relays() -> AsyncIterator[tuple[Opener, dict[int, list[str]]]]:
    """Open relays of one made-up server (members by number); what each received, by member."""
    group = f"test-{secrets.token_hex(4)}"
    received: dict[int, list[str]] = {}
    opened: list[SiblingRelay] = []

    def open_relay(me: int, peers: list[int]) -> SiblingRelay:
        received[me] = []
        relay = SiblingRelay.open(Siblings(group=group, me=me, peers=lambda: peers), received[me].append)
        assert relay is not None
        opened.append(relay)
        return relay

    yield open_relay, received
    for relay in opened:
        relay.close()


async def until(condition: Callable[[], bool]) -> None:
    for _ in range(100):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the condition never held")


async def test_a_payload_reaches_every_sibling_but_the_sender(
    relays: tuple[Opener, dict[int, list[str]]],
) -> None:
    open_relay, received = relays
    members = [1, 2, 3]
    first = open_relay(1, members)
    open_relay(2, members)
    open_relay(3, members)
    assert first.send("@1.aa:1 orders=2") == {2, 3}
    await until(lambda: received[2] and received[3])
    assert received == {1: [], 2: ["@1.aa:1 orders=2"], 3: ["@1.aa:1 orders=2"]}
    assert first.sent == 2


async def test_a_sibling_that_is_gone_is_counted_missed_and_not_reached(
    relays: tuple[Opener, dict[int, list[str]]],
) -> None:
    open_relay, received = relays
    sender = open_relay(1, [1, 2, 3])
    gone = open_relay(2, [1, 2, 3])
    gone.close()  # its address is free again: nobody reads it
    assert sender.send("@1.aa:1 s=1") == set()  # 2 is closed, 3 never opened
    assert sender.missed == 2
    assert received[2] == []
    again = open_relay(2, [1, 2, 3])  # a new worker can bind the address at once
    assert sender.send("@1.aa:2 s=1") == {2}
    await until(lambda: bool(received[2]))
    assert received[2] == ["@1.aa:2 s=1"]
    assert again.sent == 0


async def test_two_servers_do_not_hear_each_other(relays: tuple[Opener, dict[int, list[str]]]) -> None:
    open_relay, _ = relays
    ours = open_relay(1, [1, 2])
    other_group = f"test-{secrets.token_hex(4)}"
    theirs: list[str] = []
    other = SiblingRelay.open(Siblings(group=other_group, me=2, peers=lambda: [1, 2]), theirs.append)
    assert other is not None
    try:
        assert ours.send("@1.aa:1 s=1") == set()  # nobody is member 2 in our group
        await asyncio.sleep(0.05)
        assert theirs == []
    finally:
        other.close()


async def test_a_bad_payload_does_not_stop_the_next(relays: tuple[Opener, dict[int, list[str]]]) -> None:
    open_relay, _ = relays
    sender = open_relay(1, [1, 2])
    receiver = open_relay(2, [1, 2])
    acted: list[str] = []

    def picky(payload: str) -> None:
        if payload == "boom":
            raise ValueError(payload)
        acted.append(payload)

    receiver.on_payload = picky
    sender.send("boom")
    sender.send("@1.aa:1 s=1")
    await until(lambda: bool(acted))
    assert acted == ["@1.aa:1 s=1"]


def test_the_copy_of_a_payload_is_dropped_whichever_way_comes_first() -> None:
    echoes = _Echoes()
    echoes.sibling("7.aa")  # heard by datagram once
    assert echoes.first("7.aa", 1, by_datagram=True)
    assert not echoes.first("7.aa", 1, by_datagram=False)  # the notification's copy
    assert echoes.first("7.aa", 2, by_datagram=False)  # the notification raced ahead
    assert not echoes.first("7.aa", 2, by_datagram=True)
    assert echoes.first("7.aa", 3, by_datagram=True)  # new news: acted on
    assert echoes._senders["7.aa"] == {3: True}  # nothing else kept


def test_copies_that_can_no_longer_come_are_forgotten() -> None:
    echoes = _Echoes()
    echoes.sibling("7.aa")
    for number in (1, 2, 3):  # datagrams whose notifications were never sent (sent again as 4)
        assert echoes.first("7.aa", number, by_datagram=True)
    assert echoes.first("7.aa", 4, by_datagram=True)
    assert not echoes.first("7.aa", 4, by_datagram=False)
    assert echoes._senders["7.aa"] == {}  # notifications keep order: 1-3 will never come
    assert echoes.first("7.aa", 5, by_datagram=False)  # its datagram was not delivered
    assert echoes.first("7.aa", 6, by_datagram=True)
    assert echoes._senders["7.aa"] == {6: True}  # datagrams keep order too: 5's will never come


def test_only_siblings_heard_by_datagram_are_remembered() -> None:
    echoes = _Echoes()
    for number in range(1, 50):  # a process of another server: only ever a notification
        assert echoes.first("9.bb", number, by_datagram=False)
    assert echoes._senders == {}
    assert echoes.sibling_pid("9.bb") is None
    echoes.sibling("12345.cc")
    assert echoes.sibling_pid("12345.cc") == 12345
    for n in range(MAX_ECHO_SENDERS + 1):
        echoes.sibling(f"{n}.dd")
    assert len(echoes._senders) <= MAX_ECHO_SENDERS  # bounded: forgotten all at once past the limit


def test_a_sibling_whose_copies_never_come_is_remembered_within_bounds() -> None:
    """Datagrams whose notifications are never sent (say, the copies were lost) do not pile up."""
    echoes = _Echoes()
    echoes.sibling("7.aa")
    for number in range(1, 3 * MAX_ECHOES):
        assert echoes.first("7.aa", number, by_datagram=True)
    assert len(echoes._senders["7.aa"]) <= MAX_ECHOES


async def test_a_datagram_not_from_a_siblings_socket_is_dropped(
    relays: tuple[Opener, dict[int, list[str]]],
) -> None:
    """Any process on the host may send to an abstract socket: only the siblings' own sockets count."""
    import socket as sockets

    from fastpubsub.api.siblings import address

    open_relay, received = relays
    members = [1, 2]
    first = open_relay(1, members)
    second = open_relay(2, members)
    group = first.siblings.group
    for bound in (None, address(group, 3)):  # unbound, and bound to a name that is no sibling's
        with sockets.socket(sockets.AF_UNIX, sockets.SOCK_DGRAM) as stranger:
            if bound is not None:
                stranger.bind(bound)
            stranger.sendto(b"!handed s -1 - c\n[]", address(group, 2))
    assert first.send("@1.aa:1 orders=2") == {2}  # a sibling's still counts
    await until(lambda: bool(received[2]))
    await asyncio.sleep(0.05)
    assert received[2] == ["@1.aa:1 orders=2"]
    assert second.refused == 2
