"""WebSockets against the real server (two workers) with a real client: the `websockets` library."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from tests.e2e.conftest import Server, base_env, cli


def ws_url(server: Server, path: str) -> str:
    return server.url.replace("http://", "ws://") + path


def open_socket(server: Server, path: str, **options: Any) -> Any:
    return connect(ws_url(server, path), proxy=None, open_timeout=10, **options)


async def frame(ws: ClientConnection, within: float = 10) -> dict[str, Any]:
    return dict(json.loads(await asyncio.wait_for(ws.recv(), within)))


async def frames_until(
    ws: ClientConnection, kind: str, within: float = 10
) -> tuple[dict[str, Any], list[Any]]:
    """The next frame of `kind`, and the `message` frames that came before it."""
    messages = []
    while True:
        got = await frame(ws, within)
        if got["type"] == kind:
            return got, messages
        assert got["type"] == "message", got
        messages.append(got["message"])


async def quiet(ws: ClientConnection, seconds: float) -> list[dict[str, Any]]:
    """Whatever comes within `seconds`."""
    got = []
    while True:
        try:
            got.append(await frame(ws, seconds))
        except TimeoutError:
            return got


def setup(server: Server, count: int = 0, **policy: Any) -> None:
    with server.client() as http:
        assert http.post("/topics", json={"id": "t"}).status_code == 201
        assert http.post("/subscriptions", json={"id": "s", "topic_id": "t", **policy}).status_code == 201
        if count:
            messages = [{"n": n} for n in range(count)]
            assert http.post("/topics/t/messages", json=messages).status_code == 204


def metrics(server: Server) -> dict[str, Any]:
    with server.client() as http:
        return dict(http.get("/subscriptions/s/metrics").json())


@pytest.fixture
def server(database_url: str, run_server: Callable[..., Server]) -> Server:
    return run_server(base_env(database_url))


async def test_receive_ack_nack_and_extend_on_one_socket(server: Server) -> None:
    setup(server, 3, backoff_min_seconds=0, backoff_max_seconds=0)
    async with open_socket(server, "/subscriptions/s/ws?max_in_flight=10&consumer_id=w1") as ws:
        subscribed = await frame(ws)
        assert subscribed == {
            "type": "subscribed",
            "subscription": "s",
            "consumer_id": "w1",
            "max_in_flight": 10,
        }
        got = [(await frame(ws))["message"] for _ in range(3)]
        assert sorted(m["payload"]["n"] for m in got) == [0, 1, 2]
        first, second, third = got
        await ws.send(json.dumps({"type": "ack", "id": 1, "receipts": [first["receipt"], "not-a-receipt"]}))
        acked, _ = await frames_until(ws, "acked")
        assert acked == {
            "type": "acked",
            "id": 1,
            "subscription": "s",
            "acknowledged": [first["receipt"]],
            "failed": [{"receipt": "not-a-receipt", "reason": "invalid receipt"}],
        }
        await ws.send(
            json.dumps({"type": "extend", "id": "x", "receipts": [third["receipt"]], "seconds": 120})
        )
        extended, _ = await frames_until(ws, "extended")
        assert extended["extended"] == [third["receipt"]]
        await ws.send(json.dumps({"type": "nack", "id": 2, "receipts": [second["receipt"]]}))
        nacked, before = await frames_until(ws, "nacked")
        assert nacked["nacked"] == [second["receipt"]]
        again = before or [(await frame(ws))["message"]]  # backoff 0: it comes straight back
        assert (again[0]["id"], again[0]["delivery_attempts"]) == (second["id"], 2)
        await ws.send(json.dumps({"type": "ack", "receipts": [again[0]["receipt"], third["receipt"]]}))
        acked, _ = await frames_until(ws, "acked")
        assert len(acked["acknowledged"]) == 2
    assert metrics(server)["acked"] == 3


async def test_flow_control_never_sends_more_than_granted(server: Server) -> None:
    setup(server, 12)
    async with open_socket(server, "/subscriptions/s/ws?max_in_flight=2") as ws:
        assert (await frame(ws))["type"] == "subscribed"
        first = [(await frame(ws))["message"] for _ in range(2)]
        assert await quiet(ws, 1.0) == []  # two outstanding: nothing more
        await ws.send(json.dumps({"type": "ack", "receipts": [first[0]["receipt"]]}))
        _, more = await frames_until(ws, "acked")
        more += [f["message"] for f in await quiet(ws, 1.0)]
        assert len(more) == 1  # one settled, one more sent
        await ws.send(json.dumps({"type": "flow", "id": 7, "max_in_flight": 5}))
        flow, extra = await frames_until(ws, "flow")
        assert flow == {"type": "flow", "id": 7, "subscription": "s", "max_in_flight": 5}
        extra += [f["message"] for f in await quiet(ws, 1.0)]
        assert len(extra) == 3  # outstanding: 2 + 3 = 5, never more
        assert metrics(server)["delivered"] == 5


async def test_publish_subscribe_and_unsubscribe_on_the_multiplexed_socket(server: Server) -> None:
    setup(server)
    with server.client() as http:
        http.post("/subscriptions", json={"id": "s2", "topic_id": "t"})
    async with open_socket(server, "/ws") as ws:
        await ws.send(json.dumps({"type": "subscribe", "id": "a", "subscription": "s", "max_in_flight": 10}))
        assert (await frame(ws))["type"] == "subscribed"
        await ws.send(json.dumps({"type": "subscribe", "id": "b", "subscription": "s2"}))
        assert (await frame(ws))["type"] == "subscribed"
        await ws.send(json.dumps({"type": "publish", "id": 1, "topic": "t", "data": {"k": "one"}}))
        published, seen = await frames_until(ws, "published")
        assert published["id"] == 1
        assert len(published["message_ids"]) == 1
        envelopes = [{"payload": {"k": "two"}, "attributes": {"source": "ws"}, "priority": 5}]
        await ws.send(json.dumps({"type": "publish", "id": 2, "topic": "t", "messages": envelopes}))
        second, more = await frames_until(ws, "published")
        seen += more + [f["message"] for f in await quiet(ws, 1.0)]
        ids = {*published["message_ids"], *second["message_ids"]}
        assert {(m["subscription_id"], m["id"]) for m in seen} == {(s, i) for s in ("s", "s2") for i in ids}
        assert {m["attributes"]["source"] for m in seen if m["payload"]["k"] == "two"} == {"ws"}
        await ws.send(json.dumps({"type": "unsubscribe", "id": 3, "subscription": "s2"}))
        assert (await frames_until(ws, "unsubscribed"))[0]["id"] == 3
        await ws.send(json.dumps({"type": "publish", "topic": "t", "data": {"k": "three"}}))
        # (Handed to the stream by the publish itself, a message may come before the answer.)
        _, sooner = await frames_until(ws, "published")
        later = sooner + [f["message"] for f in await quiet(ws, 1.0)]
        assert [m["subscription_id"] for m in later] == ["s"]
        await ws.send(json.dumps({"type": "ping", "id": 9}))
        assert await frame(ws) == {"type": "pong", "id": 9}
        pong = await ws.ping()  # the protocol's own ping frames are answered too
        await asyncio.wait_for(pong, 5)


async def test_bad_frames_get_an_error_answer_and_the_socket_stays_open(server: Server) -> None:
    setup(server)
    async with open_socket(server, "/ws") as ws:
        cases = [
            ("not json", 422, "JSON"),
            ('{"type": "dance"}', 422, "type"),
            ('{"type": "subscribe", "subscription": "nope", "id": 4}', 404, "not found"),
            ('{"type": "publish", "topic": "t", "data": {"a": 1}, "messages": []}', 422, "not both"),
            ('{"type": "publish", "topic": "t", "messages": [{"payload": 5}]}', 422, "payload"),
            ('{"type": "ack", "receipts": ["r"]}', 422, "name the subscription"),
            # What belongs to another settlement is refused, not ignored.
            (
                '{"type": "ack", "subscription": "s", "receipts": ["r"], "requeue": false}',
                422,
                "requeue is for nack",
            ),
            (
                '{"type": "nack", "subscription": "s", "receipts": ["r"], "seconds": 5}',
                422,
                "seconds is for extend",
            ),
            (
                '{"type": "extend", "subscription": "s", "receipts": ["r"], "seconds": 5, "requeue": true}',
                422,
                "requeue",
            ),
            ('{"type": "unsubscribe", "subscription": "s"}', 422, "not subscribed"),
            # Nothing a frame holds may break the socket, nor reach a message changed.
            ("[" * 3000 + "]" * 3000, 422, "nested too deeply"),
            ('{"type": "publish", "topic": "t", "data": {"a": "\\ud800"}}', 422, "surrogate pair"),
            ('{"type": "publish", "topic": "t", "messages": [{"payload": {"a": 1e400}}]}', 422, "finite"),
            ('{"type": "publish", "topic": "t", "messages": [{"payload": {"a": NaN}}]}', 422, "finite"),
        ]
        for text, status, detail in cases:
            await ws.send(text)
            error = await frame(ws)
            assert (error["type"], error["status"]) == ("error", status), (text, error)
            assert detail in json.dumps(error["detail"]), (text, error)
        # A refused frame's answer repeats its id, whatever made it invalid, so
        # that a client waiting for that id hears of it; an id that is not one
        # (true, a list) is not repeated.
        for refused, request_id in [
            ({"type": "ack", "receipts": [], "id": 6}, 6),
            ({"type": "flow", "max_in_flight": 0, "id": "s"}, "s"),
            ({"type": "dance", "id": 7}, 7),
            ({"type": "ping", "extra": 1, "id": "p"}, "p"),
            ({"type": "ping", "id": True}, None),
            ({"type": "ping", "id": 1.0}, None),
            ({"type": "ping", "id": [1]}, None),
            ({"type": "ping", "id": "\ud800"}, None),  # not JSON text: the frame is not read
        ]:
            await ws.send(json.dumps(refused))
            error = await frame(ws)
            assert (error["type"], error["status"]) == ("error", 422), (refused, error)
            assert error["id"] == request_id, (refused, error)
        await ws.send(json.dumps({"type": "ping"}))
        assert await frame(ws) == {"type": "pong"}
    assert metrics(server)["available"] == 0  # none of them published anything


async def test_a_dropped_sockets_messages_are_delivered_again(server: Server) -> None:
    setup(server, 3, ack_deadline_seconds=1)
    async with open_socket(server, "/subscriptions/s/ws?max_in_flight=10") as ws:
        await frame(ws)
        first = {(await frame(ws))["message"]["id"] for _ in range(3)}
    # Gone without settling anything: the leases run out after the ack deadline.
    async with open_socket(server, "/subscriptions/s/ws?max_in_flight=10") as ws:
        await frame(ws)
        again = [(await frame(ws, within=15))["message"] for _ in range(3)]
    assert {m["id"] for m in again} == first
    assert {m["delivery_attempts"] for m in again} == {2}


async def test_the_subscription_route_closes_with_a_code_that_says_why(server: Server) -> None:
    setup(server)
    for path, code in [
        ("/subscriptions/nope/ws", 4404),
        ("/subscriptions/s/ws?max_in_flight=0", 4422),
        ("/subscriptions/s/ws?max_in_flight=many", 4422),
        # Digits beyond ASCII ("³", "①", Arabic-Indic 3) are not numbers here, as on REST.
        ("/subscriptions/s/ws?max_in_flight=%C2%B3", 4422),
        ("/subscriptions/s/ws?max_in_flight=%E2%91%A0", 4422),
        ("/subscriptions/s/ws?max_in_flight=%D9%A3", 4422),
        ("/subscriptions/s/ws?max_in_flight=" + "9" * 5000, 4422),
    ]:
        async with open_socket(server, path) as ws:
            with pytest.raises(ConnectionClosed) as closed:
                await frame(ws)
        assert closed.value.rcvd is not None
        assert closed.value.rcvd.code == code, path
    reasons = {}
    for given in ["many", "%C2%B3", "0", "1001", "9" * 30]:
        async with open_socket(server, f"/subscriptions/s/ws?max_in_flight={given}") as ws:
            with pytest.raises(ConnectionClosed) as closed:
                await frame(ws)
        assert closed.value.rcvd is not None
        reasons[given] = closed.value.rcvd.reason
    assert "valid integer" in reasons["many"], reasons
    assert "valid integer" in reasons["%C2%B3"], reasons
    assert "greater than or equal to 1" in reasons["0"], reasons
    assert "less than or equal to 1000" in reasons["1001"], reasons
    assert "less than or equal to 1000" in reasons["9" * 30], reasons
    # In range, it is taken.
    for given, taken in [("0007", 7), ("0000000000000012", 12)]:
        async with open_socket(server, f"/subscriptions/s/ws?max_in_flight={given}") as ws:
            assert (await frame(ws))["max_in_flight"] == taken


async def test_a_web_page_from_another_origin_cannot_open_a_socket(server: Server) -> None:
    with pytest.raises(InvalidStatus) as refused:
        async with open_socket(server, "/ws", origin="https://evil.example"):
            pass
    assert refused.value.response.status_code == 403


@pytest.fixture
def secured(database_url: str, run_server: Callable[..., Server]) -> tuple[Server, Callable[[str], str]]:
    key = re.search(r"^new_secret=(\S+)$", cli(base_env(database_url), "generate-secret-key"), re.M)
    assert key is not None
    env = base_env(database_url, auth_enabled="true", auth_secret_key=key.group(1))
    server = run_server(env)

    def token(scopes: str) -> str:
        values = dict(line.split("=", 1) for line in cli(env, "create-client", "ws", scopes, "true").split())
        answer = httpx.post(
            f"{server.url}/oauth/token",
            json={"client_id": values["client_id"], "client_secret": values["client_secret"]},
            timeout=10,
        )
        return str(answer.json()["access_token"])

    return server, token


async def test_sockets_are_authenticated_like_the_rest_of_the_api(
    secured: tuple[Server, Callable[[str], str]],
) -> None:
    server, token = secured
    admin = {"Authorization": f"Bearer {token('*')}"}
    with server.client(headers=admin) as http:
        http.post("/topics", json={"id": "t"})
        http.post("/subscriptions", json={"id": "s", "topic_id": "t"})
        http.post("/topics/t/messages", json=[{"n": 1}])
    async with open_socket(server, "/subscriptions/s/ws") as ws:  # no token at all
        with pytest.raises(ConnectionClosed) as closed:
            await frame(ws, within=15)
    assert closed.value.rcvd is not None
    assert closed.value.rcvd.code == 4401
    async with open_socket(server, "/ws", additional_headers={"Authorization": "Bearer forged"}) as ws:
        with pytest.raises(ConnectionClosed) as closed:
            await frame(ws)
    assert closed.value.rcvd is not None
    assert closed.value.rcvd.code == 4401
    reader = token("subscriptions:read")
    async with open_socket(
        server, "/subscriptions/s/ws", additional_headers={"Authorization": f"Bearer {reader}"}
    ) as ws:
        with pytest.raises(ConnectionClosed) as closed:
            await frame(ws)
    assert closed.value.rcvd is not None
    assert closed.value.rcvd.code == 4403
    # A first frame that is not a valid auth frame closes the socket as unauthenticated.
    deep = "[" * 3000 + "]" * 3000
    for first in ['{"type": "auth"}', '{"type": "auth", "token": ""}', '{"type": "ping"}', "[]", "no", deep]:
        async with open_socket(server, "/subscriptions/s/ws") as ws:
            await ws.send(first)
            with pytest.raises(ConnectionClosed) as closed:
                await frame(ws)
        assert closed.value.rcvd is not None
        assert closed.value.rcvd.code == 4401, first
    assert metrics_with(server, admin)["delivered"] == 0  # nothing was leased to any of them
    # A browser cannot set headers: the token comes in the first frame.
    consumer = token("subscriptions:consume:s")
    async with open_socket(server, "/subscriptions/s/ws") as ws:
        await ws.send(json.dumps({"type": "auth", "token": consumer}))
        assert (await frame(ws))["type"] == "authenticated"
        assert (await frame(ws))["type"] == "subscribed"
        message = (await frame(ws))["message"]
        await ws.send(json.dumps({"type": "publish", "id": 1, "topic": "t", "data": {"n": 2}}))
        refused = await frame(ws)
        assert (refused["type"], refused["status"], refused["id"]) == ("error", 403, 1)
        assert "topics:publish" in refused["detail"]
        await ws.send(json.dumps({"type": "ack", "receipts": [message["receipt"]]}))
        assert (await frame(ws))["acknowledged"] == [message["receipt"]]


def metrics_with(server: Server, headers: dict[str, str]) -> dict[str, Any]:
    with server.client(headers=headers) as http:
        return dict(http.get("/subscriptions/s/metrics").json())


async def pinging(ws: ClientConnection, times: int) -> None:
    """Ping and read the answer, `times` times, a quarter of a second apart."""
    for _ in range(times):
        await ws.send(json.dumps({"type": "ping"}))
        await frame(ws)
        await asyncio.sleep(0.25)


async def test_a_socket_closes_once_its_client_is_disabled(
    database_url: str, run_server: Callable[..., Server]
) -> None:
    """As HTTP refuses a revoked token within seconds, an open socket carrying it is closed (4401):
    it neither receives nor publishes any more."""
    key = re.search(r"^new_secret=(\S+)$", cli(base_env(database_url), "generate-secret-key"), re.M)
    assert key is not None
    env = base_env(database_url, auth_enabled="true", auth_secret_key=key.group(1))
    server = run_server(env)
    values = dict(line.split("=", 1) for line in cli(env, "create-client", "ws", "*", "true").split())
    async with httpx.AsyncClient(base_url=server.url, timeout=10) as http:
        answer = await http.post(
            "/oauth/token", json={"client_id": values["client_id"], "client_secret": values["client_secret"]}
        )
        headers = {"Authorization": f"Bearer {answer.json()['access_token']}"}
        await http.post("/topics", json={"id": "t"}, headers=headers)
    async with open_socket(server, "/ws", additional_headers=headers) as ws:
        await ws.send(json.dumps({"type": "publish", "id": 1, "topic": "t", "data": {"n": 1}}))
        assert (await frame(ws))["type"] == "published"
        cli(env, "update-client", values["client_id"], "--inactive")
        with pytest.raises(ConnectionClosed) as closed:
            await pinging(ws, times=60)  # bounded: it closes within a few seconds
    assert closed.value.rcvd is not None
    assert (closed.value.rcvd.code, closed.value.rcvd.reason) == (4401, "the access token has been revoked")


async def test_a_new_token_with_narrower_scopes_ends_the_streams_it_may_not_consume(
    database_url: str, run_server: Callable[..., Server]
) -> None:
    """An auth frame may bring a token narrowed to fewer subscriptions (OAuth2's `scope`): the
    streams it does not cover end (403, as subscribing would be refused), the others go on."""
    key = re.search(r"^new_secret=(\S+)$", cli(base_env(database_url), "generate-secret-key"), re.M)
    assert key is not None
    env = base_env(database_url, auth_enabled="true", auth_secret_key=key.group(1))
    server = run_server(env)
    values = dict(line.split("=", 1) for line in cli(env, "create-client", "ws", "*", "true").split())
    credentials = {"client_id": values["client_id"], "client_secret": values["client_secret"]}
    async with httpx.AsyncClient(base_url=server.url, timeout=10) as http:
        token = (await http.post("/oauth/token", json=credentials)).json()["access_token"]
        headers = {"Authorization": f"Bearer {token}"}
        await http.post("/topics", json={"id": "t"}, headers=headers)
        for name in ("s1", "s2"):
            await http.post("/subscriptions", json={"id": name, "topic_id": "t"}, headers=headers)
        narrowed = await http.post(
            "/oauth/token",
            data={**credentials, "grant_type": "client_credentials", "scope": "subscriptions:consume:s2"},
        )
        assert narrowed.status_code == 200, narrowed.text
        async with open_socket(server, "/ws", additional_headers=headers) as ws:
            for name in ("s1", "s2"):
                await ws.send(json.dumps({"type": "subscribe", "id": name, "subscription": name}))
                assert (await frame(ws))["type"] == "subscribed"
            await ws.send(json.dumps({"type": "auth", "id": "a", "token": narrowed.json()["access_token"]}))
            ended = await frame(ws)
            assert ended == {
                "type": "error",
                "subscription": "s1",
                "status": 403,
                "detail": 'unsubscribed: this requires the scope "subscriptions:consume" on s1',
            }
            assert await frame(ws) == {"type": "authenticated", "id": "a"}
            assert (
                await http.post("/topics/t/messages", json=[{"n": 1}], headers=headers)
            ).status_code == 204
            got = [m["message"]["subscription_id"] for m in await quiet(ws, 1.5)]
        assert got == ["s2"]
        # s1's message was not leased by the stream that ended: another consumer takes it at once.
        polled = await http.get("/subscriptions/s1/messages", params={"consumer_id": "c"}, headers=headers)
        assert [m["payload"] for m in polled.json()["data"]] == [{"n": 1}]


async def test_a_frame_over_a_mebibyte_in_utf8_closes_the_socket(server: Server) -> None:
    """The limit counts bytes: 700,000 two-byte characters are 1.4 MB."""
    setup(server)
    async with open_socket(server, "/ws") as ws:
        await ws.send(json.dumps({"type": "ping", "pad": "é" * 700_000}, ensure_ascii=False))
        with pytest.raises(ConnectionClosed) as closed:
            await frame(ws)
    assert closed.value.rcvd is not None
    assert closed.value.rcvd.code == 1009


async def test_a_server_stopping_closes_its_sockets_with_1001(
    database_url: str, run_server: Callable[..., Server]
) -> None:
    import signal

    server = run_server(base_env(database_url))
    setup(server)
    async with open_socket(server, "/subscriptions/s/ws") as ws:
        assert (await frame(ws))["type"] == "subscribed"
        server.process.send_signal(signal.SIGTERM)
        with pytest.raises(ConnectionClosed) as closed:
            await frame(ws, within=20)
    assert closed.value.rcvd is not None
    assert (closed.value.rcvd.code, closed.value.rcvd.reason) == (1001, "the server is stopping")
