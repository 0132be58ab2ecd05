"""OAuth2 client credentials, scoped JWTs, revocation, and every way a token can be bad."""

from __future__ import annotations

import asyncio
import base64
import json
import time
import uuid
from collections.abc import Awaitable, Callable

import httpx
import jwt
import pytest

from fastpubsub.api.app import create_app
from fastpubsub.db import Database
from fastpubsub.exceptions import ConfigurationError
from tests.api.conftest import SECRET_KEY, ClientFactory, create_client_record, make_settings, token_for

Bearer = Callable[[str], Awaitable[dict[str, str]]]


def basic(client_id: str, secret: str) -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(f"{client_id}:{secret}".encode()).decode()}


FORM = {"content-type": "application/x-www-form-urlencoded"}


async def test_json_token_request_answers_201(secured: httpx.AsyncClient, database_url: str) -> None:
    client_id, secret = await create_client_record(database_url, "topics:create topics:read")
    response = await secured.post("/oauth/token", json={"client_id": client_id, "client_secret": secret})
    assert response.status_code == 201
    body = response.json()
    assert body["token_type"] == "Bearer"
    assert body["expires_in"] == 1800
    assert body["scope"] == "topics:create topics:read"
    assert response.headers["cache-control"] == "no-store"
    claims = jwt.decode(body["access_token"], SECRET_KEY, algorithms=["HS256"])
    assert claims["sub"] == client_id
    assert claims["ver"] == 1


async def test_form_request_with_credentials_in_the_body(
    secured: httpx.AsyncClient, database_url: str
) -> None:
    client_id, secret = await create_client_record(database_url, "*")
    response = await secured.post(
        "/oauth/token",
        data={"grant_type": "client_credentials", "client_id": client_id, "client_secret": secret},
    )
    assert response.status_code == 200
    assert response.json()["scope"] == "*"


async def test_form_request_with_http_basic_and_a_narrower_scope(
    secured: httpx.AsyncClient, database_url: str
) -> None:
    client_id, secret = await create_client_record(database_url, "topics:read topics:create")
    response = await secured.post(
        "/oauth/token",
        content="grant_type=client_credentials&scope=topics%3Aread",
        headers={**FORM, **basic(client_id, secret)},
    )
    assert response.status_code == 200
    assert response.json()["scope"] == "topics:read"
    token = response.json()["access_token"]
    auth = {"Authorization": f"Bearer {token}"}
    assert (await secured.get("/topics", headers=auth)).status_code == 200
    assert (await secured.post("/topics", json={"id": "x"}, headers=auth)).status_code == 403


@pytest.mark.parametrize(
    ("content", "status", "error"),
    [
        ("grant_type=password&username=a&password=b", 400, "unsupported_grant_type"),
        ("client_id=a&client_secret=b", 400, "invalid_request"),
        ("grant_type=client_credentials", 401, "invalid_client"),
        ("grant_type=client_credentials&grant_type=client_credentials", 400, "invalid_request"),
        ("grant_type=client_credentials&client_id=x&client_secret=y", 401, "invalid_client"),
        ("%%%", 400, "invalid_request"),
    ],
)
async def test_form_errors_follow_rfc_6749(
    secured: httpx.AsyncClient, content: str, status: int, error: str
) -> None:
    response = await secured.post("/oauth/token", content=content, headers=FORM)
    assert response.status_code == status
    body = response.json()
    assert body["error"] == error
    assert body["detail"]


async def test_credentials_twice_is_invalid_request(secured: httpx.AsyncClient, database_url: str) -> None:
    client_id, secret = await create_client_record(database_url, "*")
    response = await secured.post(
        "/oauth/token",
        content=f"grant_type=client_credentials&client_id={client_id}&client_secret={secret}",
        headers={**FORM, **basic(client_id, secret)},
    )
    assert response.status_code == 400
    assert response.json()["error"] == "invalid_request"


async def test_scope_outside_the_clients_is_invalid_scope(
    secured: httpx.AsyncClient, database_url: str
) -> None:
    client_id, secret = await create_client_record(database_url, "topics:read")
    response = await secured.post(
        "/oauth/token",
        content="grant_type=client_credentials&scope=*",
        headers={**FORM, **basic(client_id, secret)},
    )
    assert response.status_code == 400
    assert response.json()["error"] == "invalid_scope"


async def test_unknown_client_wrong_secret_and_disabled_client_look_the_same(
    secured: httpx.AsyncClient, database_url: str
) -> None:
    active_id, secret = await create_client_record(database_url, "*")
    disabled_id, disabled_secret = await create_client_record(database_url, "*", is_active=False)
    attempts = [
        {"client_id": str(uuid.uuid4()), "client_secret": secret},
        {"client_id": active_id, "client_secret": secret + "x"},
        {"client_id": disabled_id, "client_secret": disabled_secret},
    ]
    answers = []
    for body in attempts:
        response = await secured.post("/oauth/token", json=body)
        answers.append((response.status_code, response.json()))
    assert all(answer == answers[0] for answer in answers)
    assert answers[0][0] == 401
    assert answers[0][1]["error"] == "invalid_client"


async def test_malformed_json_token_request_is_422(secured: httpx.AsyncClient) -> None:
    for body in (b"{", b'{"client_id": "not-a-uuid", "client_secret": "x"}', b"[]"):
        response = await secured.post(
            "/oauth/token", content=body, headers={"content-type": "application/json"}
        )
        assert response.status_code == 422
        assert "detail" in response.json()
    response = await secured.post("/oauth/token", content=b"x", headers={"content-type": "text/plain"})
    assert response.status_code == 415


def forged(claims: dict, key: str = SECRET_KEY, algorithm: str = "HS256") -> str:
    base: dict = {
        "iss": "fastpubsub",
        "sub": str(uuid.uuid4()),
        "scope": "*",
        "ver": 1,
        "iat": int(time.time()),
    }
    base["exp"] = base["iat"] + 600
    return jwt.encode({**base, **claims}, key, algorithm=algorithm)


def unsigned(claims: dict) -> str:
    def part(data: dict) -> str:
        return base64.urlsafe_b64encode(json.dumps(data).encode()).rstrip(b"=").decode()

    return f"{part({'alg': 'none', 'typ': 'JWT'})}.{part(claims)}."


@pytest.mark.parametrize(
    "authorization",
    [
        None,
        "",
        "Bearer",
        "Bearer ",
        "Basic abc",
        "Bearer not.a.jwt",
        "Bearer " + "a" * 5000,
        "Bearer " + forged({}, key="another-key-" + "x" * 60),
        "Bearer " + forged({"exp": int(time.time()) - 10}),
        "Bearer " + forged({"iss": "someone-else"}),
        "Bearer " + forged({"sub": "not-a-uuid"}),
        "Bearer " + unsigned({"iss": "fastpubsub", "sub": str(uuid.uuid4()), "scope": "*", "ver": 1}),
        "Bearer " + forged({}, algorithm="HS512"),
        "Bearer " + forged({"ver": float("inf")}),
        "Bearer " + forged({"ver": float("nan")}),
        "Bearer " + forged({"ver": True}),
        "Bearer " + forged({"ver": "1"}),
        "Bearer " + forged({"ver": 1.5}),
        "Bearer " + forged({"ver": 10**40}),
        "Bearer " + forged({"scope": ["*"]}),
        "Bearer " + forged({"sub": 12345}),
    ],
    ids=[
        "missing",
        "empty",
        "no-token",
        "blank-token",
        "basic",
        "garbage",
        "huge",
        "wrong-key",
        "expired",
        "wrong-issuer",
        "bad-subject",
        "alg-none",
        "other-algorithm",
        "version-infinity",
        "version-nan",
        "version-bool",
        "version-string",
        "version-fraction",
        "version-huge",
        "scope-list",
        "subject-number",
    ],
)
async def test_bad_tokens_are_401_with_www_authenticate(
    secured: httpx.AsyncClient, authorization: str | None
) -> None:
    headers = {"Authorization": authorization} if authorization is not None else {}
    response = await secured.get("/topics", headers=headers)
    assert response.status_code == 401
    assert response.headers["www-authenticate"].startswith("Bearer")
    assert "detail" in response.json()


async def test_a_valid_token_of_an_unknown_client_is_401(secured: httpx.AsyncClient) -> None:
    response = await secured.get("/topics", headers={"Authorization": "Bearer " + forged({})})
    assert response.status_code == 401


async def test_updating_disabling_rotating_and_deleting_revoke_tokens(
    secured: httpx.AsyncClient, database_url: str, bearer: Bearer
) -> None:
    admin = await bearer("*")
    for change in ("update", "disable", "rotate", "delete"):
        client_id, secret = await create_client_record(database_url, "topics:read")
        headers = {"Authorization": f"Bearer {await token_for(secured, client_id, secret)}"}
        assert (await secured.get("/topics", headers=headers)).status_code == 200
        if change == "update":
            response = await secured.put(
                f"/clients/{client_id}",
                json={"name": "n", "scopes": "topics:read", "is_active": True},
                headers=admin,
            )
            assert response.json()["token_version"] == 2
        elif change == "disable":
            await secured.put(
                f"/clients/{client_id}",
                json={"name": "n", "scopes": "topics:read", "is_active": False},
                headers=admin,
            )
        elif change == "rotate":
            rotated = await secured.post(f"/clients/{client_id}/secret", headers=admin)
            assert rotated.status_code == 200
            new_secret = rotated.json()["secret"]
            assert (
                await secured.post("/oauth/token", json={"client_id": client_id, "client_secret": secret})
            ).status_code == 401
            await token_for(secured, client_id, new_secret)
        else:
            assert (await secured.delete(f"/clients/{client_id}", headers=admin)).status_code == 204
        revoked = await secured.get("/topics", headers=headers)
        assert revoked.status_code == 401, change
        assert revoked.json() == {"detail": "the access token has been revoked"}


async def signed_in(api: httpx.AsyncClient, database_url: str, scopes: str) -> tuple[str, dict[str, str]]:
    """A new client with these scopes, and the Authorization header of a token of its own."""
    client_id, secret = await create_client_record(database_url, scopes)
    return client_id, {"Authorization": f"Bearer {await token_for(api, client_id, secret)}"}


async def test_revocation_takes_effect_within_the_cache_lifetime(
    make_api: ClientFactory, database_url: str
) -> None:
    api = await make_api(auth_enabled=True, auth_client_cache_seconds=1)
    _, admin = await signed_in(api, database_url, "*")
    client_id, headers = await signed_in(api, database_url, "topics:read")
    assert (await api.get("/topics", headers=headers)).status_code == 200
    # Another worker process would not see this request: change it behind the API's back.
    database = Database(database_url, pool_size=1, max_overflow=0)
    await database.update_client(uuid.UUID(client_id), "n", "topics:read", False)
    await database.close()
    deadline = time.monotonic() + 5
    while (await api.get("/topics", headers=headers)).status_code == 200:
        assert time.monotonic() < deadline, "token still accepted 5 s after the client was disabled"
        await asyncio.sleep(0.1)
    assert (await api.get("/topics", headers=admin)).status_code == 200


def count_state_lookups(
    api: httpx.AsyncClient, *, hold: float, read: asyncio.Event | None = None
) -> list[uuid.UUID]:
    """Record each client-state lookup the app makes; each holds its answer `hold` s after reading it.

    `read` is set once a lookup has read the state.
    """
    database: Database = api.app.state.database  # type: ignore[attr-defined]
    read_state = database.client_token_state
    lookups: list[uuid.UUID] = []

    async def counted(client_id: uuid.UUID) -> object:
        lookups.append(client_id)
        state = await read_state(client_id)
        if read is not None:
            read.set()
        await asyncio.sleep(hold)
        return state

    database.client_token_state = counted  # type: ignore[method-assign]
    return lookups


async def test_requests_that_find_a_client_state_run_out_share_one_lookup(
    make_api: ClientFactory, database_url: str
) -> None:
    api = await make_api(auth_enabled=True, auth_client_cache_seconds=0.5)
    client_id, headers = await signed_in(api, database_url, "topics:read")
    lookups = count_state_lookups(api, hold=0.1)
    for _ in range(2):  # the first requests, then again once the state has run out
        answers = await asyncio.gather(*(api.get("/topics", headers=headers) for _ in range(20)))
        assert [a.status_code for a in answers] == [200] * 20
        assert lookups == [uuid.UUID(client_id)]
        assert (await api.get("/topics", headers=headers)).status_code == 200  # kept meanwhile
        assert len(lookups) == 1
        await asyncio.sleep(0.6)
        lookups.clear()


async def test_a_lookup_under_way_when_this_process_revokes_a_client_does_not_bring_it_back(
    make_api: ClientFactory, database_url: str
) -> None:
    api = await make_api(auth_enabled=True, auth_client_cache_seconds=5)
    _, admin = await signed_in(api, database_url, "*")
    assert (await api.get("/topics", headers=admin)).status_code == 200  # the admin's state is kept
    client_id, headers = await signed_in(api, database_url, "topics:read")
    read = asyncio.Event()
    lookups = count_state_lookups(api, hold=0.5, read=read)
    # The client's state is read (active), and held while the admin disables it.
    before = asyncio.create_task(api.get("/topics", headers=headers))
    await asyncio.wait_for(read.wait(), 10)
    update = {"name": "n", "scopes": "topics:read", "is_active": False}
    assert (await api.put(f"/clients/{client_id}", json=update, headers=admin)).status_code == 200
    assert (await before).status_code == 200  # it was asked before the change
    after = await api.get("/topics", headers=headers)
    assert after.status_code == 401
    assert after.json() == {"detail": "the access token has been revoked"}
    assert lookups == [uuid.UUID(client_id)] * 2


async def test_object_specific_scopes_apply_to_the_object_touched(
    secured: httpx.AsyncClient, bearer: Bearer
) -> None:
    admin = await bearer("*")
    for topic in ("orders", "payments"):
        await secured.post("/topics", json={"id": topic}, headers=admin)
        await secured.post("/subscriptions", json={"id": f"{topic}-sub", "topic_id": topic}, headers=admin)
    publisher = await bearer("topics:publish:orders")
    assert (
        await secured.post("/topics/orders/messages", json=[{"a": 1}], headers=publisher)
    ).status_code == 204
    denied = await secured.post("/topics/payments/messages", json=[{"a": 1}], headers=publisher)
    assert denied.status_code == 403
    assert denied.json() == {"detail": 'this requires the scope "topics:publish" on payments'}
    assert (await secured.get("/topics", headers=publisher)).status_code == 403

    consumer = await bearer("subscriptions:consume:orders-sub")
    params = {"consumer_id": "w"}
    got = await secured.get("/subscriptions/orders-sub/messages", params=params, headers=consumer)
    assert got.status_code == 200
    ids = [m["id"] for m in got.json()["data"]]
    assert (
        await secured.post("/subscriptions/orders-sub/acks", json=ids, headers=consumer)
    ).status_code == 204
    for path in ("/subscriptions/payments-sub/messages",):
        assert (await secured.get(path, params=params, headers=consumer)).status_code == 403
    assert (await secured.get("/subscriptions/orders-sub/metrics", headers=consumer)).status_code == 403

    global_publisher = await bearer("topics:publish")
    assert (
        await secured.post("/topics/payments/messages", json=[{"a": 1}], headers=global_publisher)
    ).status_code == 204


async def test_clients_cannot_grant_scopes_they_do_not_hold(
    secured: httpx.AsyncClient, bearer: Bearer
) -> None:
    manager = await bearer("clients:create clients:update topics:publish subscriptions:read:s1")
    for scopes, status in [
        ("topics:publish", 201),
        ("topics:publish:orders", 201),
        ("subscriptions:read:s1", 201),
        ("subscriptions:read", 403),
        ("subscriptions:read:s2", 403),
        ("*", 403),
        ("clients:delete", 403),
    ]:
        response = await secured.post(
            "/clients", json={"name": "x", "scopes": scopes, "is_active": True}, headers=manager
        )
        assert response.status_code == status, scopes
    admin = await bearer("*")
    response = await secured.post(
        "/clients", json={"name": "root", "scopes": "*", "is_active": True}, headers=admin
    )
    assert response.status_code == 201
    created = response.json()
    assert len(created["secret"]) >= 43  # 32 random bytes
    update = await secured.put(
        f"/clients/{created['id']}", json={"name": "root", "scopes": "*", "is_active": True}, headers=manager
    )
    assert update.status_code == 403


@pytest.mark.parametrize(
    ("scopes", "problem"),
    [
        ("", "scopes must not be empty"),
        ("topics:fly", 'unknown scope "topics:fly"'),
        ("nothing", 'unknown scope "nothing"'),
        ("topics:read TOPICS:READ", 'unknown scope "TOPICS:READ"'),
        ("topics:read:bad id", 'unknown scope "id"'),
        ("topics:read:a:b", 'unknown scope "topics:read:a:b"'),
        ("topics:read:*", 'scope "topics:read:*" names an invalid object id'),
        ("subscriptions:read topics:read:\u00e9", 'scope "topics:read:\u00e9" names an invalid object id'),
    ],
)
async def test_client_scopes_are_validated_naming_the_scope_at_fault(
    secured: httpx.AsyncClient, bearer: Bearer, scopes: str, problem: str
) -> None:
    admin = await bearer("*")
    created = await secured.post(
        "/clients", json={"name": "x", "scopes": scopes, "is_active": True}, headers=admin
    )
    assert created.status_code == 422
    assert created.json()["detail"] == [{"loc": ["body", "scopes"], "msg": problem, "type": "scopes"}]
    client = await secured.post("/clients", json={"name": "y", "scopes": "topics:read"}, headers=admin)
    updated = await secured.put(
        f"/clients/{client.json()['id']}", json={"name": "y", "scopes": scopes}, headers=admin
    )
    assert updated.status_code == 422
    assert updated.json()["detail"] == [{"loc": ["body", "scopes"], "msg": problem, "type": "scopes"}]


ONE_LINE = "name must be one line of text: no line breaks, tabs or other control characters, not only spaces"


@pytest.mark.parametrize("name", ["line1\nline2", "a\tb", "   ", "bell\x07", "del\x7f"])
async def test_a_client_name_is_one_line_of_text(
    secured: httpx.AsyncClient, bearer: Bearer, name: str
) -> None:
    # Names with line breaks or tabs were taken, and broke every table that lists clients.
    admin = await bearer("*")

    async def create(name: str) -> httpx.Response:
        return await secured.post("/clients", json={"name": name, "scopes": "topics:read"}, headers=admin)

    created = await create(name)
    assert created.status_code == 422
    assert created.json()["detail"] == [{"loc": ["body", "name"], "msg": ONE_LINE, "type": "client_name"}]
    client = (await create("ok")).json()
    updated = await secured.put(f"/clients/{client['id']}", json={"name": name, "scopes": "x"}, headers=admin)
    assert updated.status_code == 422
    assert (await secured.get(f"/clients/{client['id']}", headers=admin)).json()["name"] == "ok"
    assert (await create(" Ünïcode app ")).status_code == 201


async def test_client_crud(secured: httpx.AsyncClient, bearer: Bearer) -> None:
    admin = await bearer("*")
    created = (
        await secured.post("/clients", json={"name": "app", "scopes": "topics:read"}, headers=admin)
    ).json()
    got = await secured.get(f"/clients/{created['id']}", headers=admin)
    assert got.status_code == 200
    body = got.json()
    assert (body["name"], body["scopes"], body["is_active"], body["token_version"]) == (
        "app",
        "topics:read",
        True,
        1,
    )
    assert "secret" not in body
    assert "secret_hash" not in body
    listed = (await secured.get("/clients", headers=admin)).json()["data"]
    assert created["id"] in [c["id"] for c in listed]
    assert (await secured.get(f"/clients/{uuid.uuid4()}", headers=admin)).status_code == 404
    assert (await secured.get("/clients/not-a-uuid", headers=admin)).status_code == 422


async def test_the_server_refuses_to_start_with_auth_and_no_key(database_url: str) -> None:
    for key in (None, "", "changeme", "short"):
        with pytest.raises(ConfigurationError):
            create_app(make_settings(database_url, auth_enabled=True, auth_secret_key=key))


async def test_token_endpoint_with_auth_disabled(api: httpx.AsyncClient) -> None:
    response = await api.post("/oauth/token", json={"client_id": str(uuid.uuid4()), "client_secret": "x"})
    assert response.status_code == 422
    assert "authentication is disabled" in response.json()["detail"]


async def test_managing_a_client_requires_holding_its_scopes(
    secured: httpx.AsyncClient, database_url: str, bearer: Bearer
) -> None:
    """clients:update/delete alone must not reach a client with more power (e.g. an admin)."""
    manager = await bearer("clients:update clients:delete topics:read")
    admin_id, admin_secret = await create_client_record(database_url, "*")
    peer_id, _ = await create_client_record(database_url, "topics:read")
    rotated = await secured.post(f"/clients/{admin_id}/secret", headers=manager)
    assert rotated.status_code == 403
    assert "secret" not in rotated.json()
    assert "detail" in rotated.json()
    update = await secured.put(
        f"/clients/{admin_id}", json={"name": "mine", "scopes": "topics:read"}, headers=manager
    )
    assert update.status_code == 403
    assert (await secured.delete(f"/clients/{admin_id}", headers=manager)).status_code == 403
    # The admin client is untouched: its secret still works and it keeps its scopes.
    await token_for(secured, admin_id, admin_secret)
    admin = {"Authorization": f"Bearer {await token_for(secured, admin_id, admin_secret)}"}
    assert (await secured.get(f"/clients/{admin_id}", headers=admin)).json()["scopes"] == "*"
    # A client whose scopes the manager holds can still be managed.
    assert (await secured.post(f"/clients/{peer_id}/secret", headers=manager)).status_code == 200
    assert (
        await secured.put(f"/clients/{peer_id}", json={"name": "p", "scopes": "topics:read"}, headers=manager)
    ).status_code == 200
    assert (await secured.delete(f"/clients/{peer_id}", headers=manager)).status_code == 204
    # An admin may manage anyone.
    other_admin_id, _ = await create_client_record(database_url, "*")
    assert (await secured.post(f"/clients/{other_admin_id}/secret", headers=admin)).status_code == 200


async def test_updating_a_client_without_is_active_leaves_it_unchanged(
    secured: httpx.AsyncClient, database_url: str, bearer: Bearer
) -> None:
    admin = await bearer("*")
    client_id, secret = await create_client_record(database_url, "topics:read", is_active=False)
    response = await secured.put(
        f"/clients/{client_id}", json={"name": "renamed", "scopes": "topics:read"}, headers=admin
    )
    assert response.status_code == 200
    assert (response.json()["name"], response.json()["is_active"]) == ("renamed", False)
    denied = await secured.post("/oauth/token", json={"client_id": client_id, "client_secret": secret})
    assert denied.status_code == 401
    enabled = await secured.put(
        f"/clients/{client_id}",
        json={"name": "renamed", "scopes": "topics:read", "is_active": True},
        headers=admin,
    )
    assert enabled.json()["is_active"] is True
    await token_for(secured, client_id, secret)


async def test_client_scopes_are_limited_in_count_and_length(
    secured: httpx.AsyncClient, bearer: Bearer
) -> None:
    admin = await bearer("*")
    many = " ".join(f"topics:publish:t{i}" for i in range(200))  # within the length, too many
    for scopes in (many, "topics:read " * 500):
        response = await secured.post("/clients", json={"name": "x", "scopes": scopes}, headers=admin)
        assert response.status_code == 422
        assert "detail" in response.json()


async def test_json_token_request_may_name_the_client_credentials_grant(
    secured: httpx.AsyncClient, database_url: str
) -> None:
    client_id, secret = await create_client_record(database_url, "topics:read")
    body = {"grant_type": "client_credentials", "client_id": client_id, "client_secret": secret}
    response = await secured.post("/oauth/token", json=body)
    assert response.status_code == 201, response.text
    assert response.json()["scope"] == "topics:read"
    for grant_type in ("password", "authorization_code", ""):
        refused = await secured.post("/oauth/token", json={**body, "grant_type": grant_type})
        assert refused.status_code == 400
        assert refused.json()["error"] == "unsupported_grant_type"
        assert refused.json()["detail"]


async def test_token_claims_must_have_their_exact_types(
    secured: httpx.AsyncClient, database_url: str
) -> None:
    client_id, secret = await create_client_record(database_url, "*")
    claims = jwt.decode(await token_for(secured, client_id, secret), options={"verify_signature": False})
    version = claims["ver"]
    assert (
        await secured.get("/topics", headers={"Authorization": "Bearer " + forged(claims)})
    ).status_code == 200
    for wrong in (
        {"ver": str(version)},
        {"ver": float(version)},
        {"ver": [version]},
        {"scope": claims["scope"].split()},
        {"sub": {"id": client_id}},
    ):
        response = await secured.get(
            "/topics", headers={"Authorization": "Bearer " + forged({**claims, **wrong})}
        )
        assert response.status_code == 401, (wrong, response.text)
        assert response.json() == {"detail": "the access token is not valid"}


async def test_a_token_is_verified_once_and_then_recognised(
    secured: httpx.AsyncClient, database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Verifying a token costs as much as a one-message publish: a token seen before is not verified again."""
    client_id, secret = await create_client_record(database_url, "topics:read")
    headers = {"Authorization": f"Bearer {await token_for(secured, client_id, secret)}"}
    verified: list[str] = []
    real = jwt.decode

    def counting(token: str, *args: object, **kwargs: object) -> dict:
        verified.append(token)
        return real(token, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr("fastpubsub.auth.jwt.decode", counting)
    for _ in range(3):
        assert (await secured.get("/topics", headers=headers)).status_code == 200
    assert len(verified) == 1
    # Another token of the same client is verified in its turn.
    other = {"Authorization": f"Bearer {await token_for(secured, client_id, secret)}"}
    assert (await secured.get("/topics", headers=other)).status_code == 200
    assert (await secured.get("/topics", headers=other)).status_code == 200
    assert len(verified) == 2


async def test_a_recognised_token_is_refused_once_it_expires(
    secured: httpx.AsyncClient, database_url: str
) -> None:
    client_id, secret = await create_client_record(database_url, "*")
    claims = jwt.decode(await token_for(secured, client_id, secret), options={"verify_signature": False})
    expires = int(time.time()) + 2
    headers = {"Authorization": "Bearer " + forged({**claims, "exp": expires})}
    assert (await secured.get("/topics", headers=headers)).status_code == 200
    await asyncio.sleep(max(expires - time.time(), 0) + 0.05)
    for _ in range(2):  # and stays refused
        response = await secured.get("/topics", headers=headers)
        assert response.status_code == 401
        assert response.json() == {"detail": "the access token has expired"}


async def test_a_refused_token_is_checked_again_each_time(
    secured: httpx.AsyncClient, database_url: str
) -> None:
    """Only tokens that passed are recognised: a tampered one fails every time, however often it comes."""
    client_id, secret = await create_client_record(database_url, "*")
    token = await token_for(secured, client_id, secret)
    assert (await secured.get("/topics", headers={"Authorization": f"Bearer {token}"})).status_code == 200
    header, payload, signature = token.split(".")
    tampered_claims = {**json.loads(base64.urlsafe_b64decode(payload + "==")), "scope": "* topics:read"}
    tampered_payload = base64.urlsafe_b64encode(json.dumps(tampered_claims).encode()).rstrip(b"=").decode()
    for bad in (f"{header}.{tampered_payload}.{signature}", f"{token}x"):
        for _ in range(2):
            response = await secured.get("/topics", headers={"Authorization": f"Bearer {bad}"})
            assert response.status_code == 401, bad
            assert response.json() == {"detail": "the access token is not valid"}


async def test_at_most_so_many_tokens_are_kept(
    secured: httpx.AsyncClient, database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("fastpubsub.auth.VerifiedTokens.MAX_TOKENS", 2)
    kept = secured.app.state.verified_tokens  # type: ignore[attr-defined]
    client_id, secret = await create_client_record(database_url, "topics:read")
    tokens = [await token_for(secured, client_id, secret) for _ in range(5)]
    for token in tokens * 2:  # each still works after the table was emptied
        assert (await secured.get("/topics", headers={"Authorization": f"Bearer {token}"})).status_code == 200
        assert len(kept._known) <= 2
