"""The web console over plain HTTP: pages show the API's figures, forms need the CSRF token, scopes rule."""

from __future__ import annotations

import re

import httpx
import pytest

from fastpubsub.console.session import CSRF_COOKIE, CSRF_FIELD, TOKEN_COOKIE
from tests.api.conftest import ClientFactory, create_client_record


def csrf_of(page: httpx.Response) -> str:
    """The CSRF token a console page put in its forms."""
    found = re.search(rf'name="{CSRF_FIELD}" value="([^"]+)"', page.text)
    assert found is not None, page.text
    return found.group(1)


async def post_form(
    client: httpx.AsyncClient, page: str, action: str, **fields: str | list[str]
) -> httpx.Response:
    """Load a console page (which sets the CSRF cookie), then send one of its forms."""
    token = csrf_of(await client.get(page))
    return await client.post(action, data={CSRF_FIELD: token, **fields})


async def sign_in(client: httpx.AsyncClient, client_id: str, secret: str) -> httpx.Response:
    return await post_form(
        client, "/console/login", "/console/login", client_id=client_id, client_secret=secret
    )


async def test_pages_show_the_apis_figures_with_auth_off(api: httpx.AsyncClient) -> None:
    assert (await api.post("/topics", json={"id": "orders"})).status_code == 201
    sub = {"id": "emails", "topic_id": "orders", "max_delivery_attempts": 1}
    assert (await api.post("/subscriptions", json=sub)).status_code == 201
    published = await api.post("/topics/orders/messages", json=[{"n": 1}, {"n": 2}, {"n": 3}])
    assert published.status_code == 204

    overview = await api.get("/console")
    assert overview.status_code == 200
    assert overview.headers["content-type"].startswith("text/html")
    assert "no-store" in overview.headers["cache-control"]
    assert "frame-ancestors 'none'" in overview.headers["content-security-policy"]
    assert 'data-figure="backlog" data-subscription="emails">3<' in overview.text
    assert 'data-figure="published_last_minute">3<' in overview.text
    # The CSRF cookie is HttpOnly and SameSite=Strict, scoped to the console.
    cookie = overview.headers["set-cookie"]
    assert f"{CSRF_COOKIE}=" in cookie
    assert "HttpOnly" in cookie
    assert "SameSite=strict" in cookie
    assert "Path=/console" in cookie

    topic = await api.get("/console/topics/orders")
    assert topic.status_code == 200
    assert 'data-figure="backlog" data-subscription="emails">3<' in topic.text
    subscription = await api.get("/console/subscriptions/emails")
    assert subscription.status_code == 200
    assert 'data-figure="available">3<' in subscription.text
    assert "Next messages" in subscription.text
    assert '<code class="payload">{&#34;n&#34;:1}</code>' in subscription.text  # peek
    clients = await api.get("/console/clients")
    assert clients.status_code == 200
    assert "fastpubsub create-client" in clients.text
    assert 'action="/console/clients"' not in clients.text
    assert (await api.get("/console/topics/nope")).status_code == 404
    wrong_method = await api.get("/console/topics")
    assert (wrong_method.status_code, wrong_method.headers["allow"]) == (405, "POST")
    assert (await api.get("/console/subscriptions/nope/dlq")).status_code == 404


async def test_forms_need_the_csrf_token_of_this_browser(api: httpx.AsyncClient) -> None:
    token = csrf_of(await api.get("/console"))
    # No token, a wrong one, or the right one sent from another site: 403 and nothing made.
    for data, headers in (
        ({"id": "a"}, {}),
        ({"id": "a", CSRF_FIELD: "forged"}, {}),
        ({"id": "a", CSRF_FIELD: token}, {"Origin": "https://evil.example"}),
    ):
        refused = await api.post("/console/topics", data=data, headers=headers)
        assert refused.status_code == 403, refused.text
        assert "text/html" in refused.headers["content-type"]
    assert (await api.get("/topics/a")).status_code == 404
    # Without the cookie the token alone is worth nothing.
    bare = httpx.AsyncClient(transport=api._transport, base_url="http://api")
    async with bare:
        assert (await bare.post("/console/topics", data={"id": "a", CSRF_FIELD: token})).status_code == 403
    made = await api.post(
        "/console/topics", data={"id": "a", CSRF_FIELD: token}, headers={"Origin": "http://api"}
    )
    assert made.status_code == 303
    assert made.headers["location"] == "/console/topics/a?notice=topic"
    assert (await api.get("/topics/a")).status_code == 200
    # JSON is not a console form: refused before anything is read.
    assert (await api.post("/console/topics", json={"id": "b"})).status_code == 422


async def test_publish_edit_seek_and_bad_input_from_the_console(api: httpx.AsyncClient) -> None:
    await api.post("/topics", json={"id": "orders"})
    await post_form(api, "/console/topics/orders", "/console/subscriptions", id="all", topic_id="orders")
    published = await post_form(
        api, "/console/topics/orders", "/console/topics/orders/publish", payload='{"k": "v"}', attributes=""
    )
    assert published.status_code == 303
    assert (await api.get("/subscriptions/all/metrics")).json()["available"] == 1
    for payload in ("[1]", "{not json", ""):
        refused = await post_form(
            api, "/console/topics/orders", "/console/topics/orders/publish", payload=payload
        )
        assert refused.status_code == 422
        assert "payload" in refused.text
    assert (await api.get("/subscriptions/all/metrics")).json()["available"] == 1

    edited = await post_form(
        api,
        "/console/subscriptions/all",
        "/console/subscriptions/all",
        filter='{"k": ["v"]}',
        max_delivery_attempts="3",
        retry_policy="linear",
        message_ttl_seconds="",
        max_backlog="100",
    )
    assert edited.status_code == 303
    got = (await api.get("/subscriptions/all")).json()
    assert (got["filter"], got["max_delivery_attempts"], got["retry_policy"], got["max_backlog"]) == (
        {"k": ["v"]},
        3,
        "linear",
        100,
    )
    bad = await post_form(
        api, "/console/subscriptions/all", "/console/subscriptions/all", max_delivery_attempts="0"
    )
    assert bad.status_code == 422
    assert "max_delivery_attempts" in bad.text
    bad_filter = await post_form(
        api, "/console/subscriptions/all", "/console/subscriptions/all", filter='{"$bogus": 1}'
    )
    assert bad_filter.status_code == 422
    assert (await api.get("/subscriptions/all")).json()["filter"] == {"k": ["v"]}

    lease = await api.get("/subscriptions/all/messages", params={"consumer_id": "w"})
    await api.post("/subscriptions/all/acks", json=[lease.json()["data"][0]["id"]])
    seek = await post_form(
        api, "/console/subscriptions/all", "/console/subscriptions/all/seek", time="2000-01-01T00:00"
    )
    assert seek.status_code == 303
    assert (await api.get("/subscriptions/all/metrics")).json()["available"] == 1


async def test_dead_letters_are_listed_with_their_reason_and_reprocessed(api: httpx.AsyncClient) -> None:
    await api.post("/topics", json={"id": "t"})
    await api.post("/subscriptions", json={"id": "s", "topic_id": "t", "max_delivery_attempts": 1})
    await api.post("/topics/t/messages", json=[{"poison": True}, {"fine": True}])
    leased = (await api.get("/subscriptions/s/messages", params={"consumer_id": "w", "batch_size": 2})).json()
    await api.post("/subscriptions/s/nacks", json=[m["id"] for m in leased["data"]])
    assert (await api.get("/subscriptions/s/metrics")).json()["dlq"] == 2

    page = await api.get("/console/subscriptions/s/dlq")
    assert page.status_code == 200
    assert "&#34;poison&#34;: true" in page.text
    assert "delivery failed once (the limit is 1)" in page.text
    ids = re.findall(r'name="id" value="([0-9a-f-]{36})"', page.text)
    assert len(ids) == 2
    poison = next(m["id"] for m in leased["data"] if m["payload"] == {"poison": True})
    done = await api.post(
        "/console/subscriptions/s/dlq/reprocess", data={CSRF_FIELD: csrf_of(page), "id": [poison]}
    )
    assert done.status_code == 303
    metrics = (await api.get("/subscriptions/s/metrics")).json()
    assert (metrics["dlq"], metrics["available"]) == (1, 1)
    nothing = await post_form(api, "/console/subscriptions/s/dlq", "/console/subscriptions/s/dlq/reprocess")
    assert nothing.status_code == 303
    assert "notice=nothing" in nothing.headers["location"]
    bad = await post_form(
        api, "/console/subscriptions/s/dlq", "/console/subscriptions/s/dlq/reprocess", id="x"
    )
    assert bad.status_code == 422


async def test_with_auth_off_the_console_makes_no_client(api: httpx.AsyncClient) -> None:
    made = await post_form(api, "/console", "/console/clients", name="x", scopes="*")
    assert made.status_code == 403
    assert "fastpubsub create-client" in made.text
    assert (await api.get("/clients")).json()["data"] == []


@pytest.fixture
async def secured_console(make_api: ClientFactory) -> httpx.AsyncClient:
    return await make_api(auth_enabled=True, auth_client_cache_seconds=0)


@pytest.fixture
async def admin_console(
    secured_console: httpx.AsyncClient, database_url: str
) -> tuple[httpx.AsyncClient, str]:
    """The console with auth on, an admin signed in; and the admin's client id."""
    admin_id, admin_secret = await create_client_record(database_url, "*")
    assert (await sign_in(secured_console, admin_id, admin_secret)).status_code == 303
    return secured_console, admin_id


async def test_disabling_a_client_needs_what_the_api_needs(
    secured_console: httpx.AsyncClient, database_url: str
) -> None:
    # PUT /clients/{id} asks for clients:update (and the target's scopes), not clients:read.
    manager_id, manager_secret = await create_client_record(database_url, "clients:update")
    target_id, target_secret = await create_client_record(database_url, "clients:update")
    await sign_in(secured_console, manager_id, manager_secret)
    disabled = await post_form(
        secured_console, "/console", f"/console/clients/{target_id}/active", active="false"
    )
    assert disabled.status_code == 303, disabled.text
    token = {"client_id": target_id, "client_secret": target_secret}
    assert (await secured_console.post("/oauth/token", json=token)).status_code == 401
    missing = await post_form(
        secured_console,
        "/console",
        "/console/clients/00000000-0000-4000-8000-000000000000/active",
        active="true",
    )
    assert missing.status_code == 404
    reader_id, reader_secret = await create_client_record(database_url, "clients:read")
    await sign_in(secured_console, reader_id, reader_secret)
    refused = await post_form(
        secured_console, "/console", f"/console/clients/{target_id}/active", active="true"
    )
    assert refused.status_code == 403


async def test_signing_in_again_leads_back_to_where_the_user_was(
    secured_console: httpx.AsyncClient, database_url: str
) -> None:
    console = secured_console
    # A page's query (which page of a list) survives the way through the sign-in page.
    first = await console.get("/console/topics/orders", params={"offset": "50"})
    assert first.headers["location"] == "/console/login?next=/console/topics/orders%3Foffset%3D50"
    client_id, secret = await create_client_record(database_url, "*")
    signed = await post_form(
        console,
        first.headers["location"],
        "/console/login",
        client_id=client_id,
        client_secret=secret,
        next="/console/topics/orders?offset=50",
    )
    assert signed.headers["location"] == "/console/topics/orders?offset=50"
    # A form sent after the session ended (its cookie gone with the token): the sign-in page says
    # nothing was sent and leads back to the form's page, not to the overview.
    console.cookies.delete(TOKEN_COOKIE, path="/console")
    sent = await console.post(
        "/console/topics/orders/publish",
        data={"payload": "{}"},
        headers={"Referer": "http://api/console/topics/orders?offset=50"},
    )
    assert sent.status_code == 401
    assert "your session has ended" in sent.text
    assert "the form was not sent" in sent.text
    assert 'name="next" value="/console/topics/orders?offset=50"' in sent.text
    elsewhere = await console.post(
        "/console/topics/orders/publish",
        data={"payload": "{}"},
        headers={"Referer": "http://other/console/x"},
    )
    assert 'name="next" value="/console"' in elsewhere.text


async def test_sign_in_keeps_the_token_in_a_strict_httponly_cookie(
    secured_console: httpx.AsyncClient, database_url: str
) -> None:
    console = secured_console
    first = await console.get("/console/subscriptions/x")
    assert first.status_code == 303
    assert first.headers["location"] == "/console/login?next=/console/subscriptions/x"
    wrong = await sign_in(console, "00000000-0000-0000-0000-000000000000", "nope")
    assert wrong.status_code == 401
    assert "invalid client credentials" in wrong.text
    assert TOKEN_COOKIE not in console.cookies
    client_id, secret = await create_client_record(database_url, "*")
    signed = await sign_in(console, client_id, secret)
    assert signed.status_code == 303
    assert signed.headers["location"] == "/console"
    cookie = next(v for v in signed.headers.get_list("set-cookie") if v.startswith(TOKEN_COOKIE))
    assert "HttpOnly" in cookie
    assert "SameSite=strict" in cookie
    assert "Path=/console" in cookie
    assert (await console.get("/console")).status_code == 200
    # The API itself still wants a bearer token: the console's cookie opens only the console.
    assert (await console.get("/topics")).status_code == 401
    # Signing in starts a new CSRF token: one read before it no longer works.
    assert (await console.post("/console/topics", data={"id": "z", CSRF_FIELD: "stale"})).status_code == 403
    signed_out = await post_form(console, "/console", "/console/logout")
    assert signed_out.status_code == 303
    assert (await console.get("/console")).status_code == 303


async def test_scopes_decide_what_pages_show_and_allow(
    admin_console: tuple[httpx.AsyncClient, str], database_url: str
) -> None:
    console, _ = admin_console
    await post_form(console, "/console", "/console/topics", id="orders")
    await post_form(console, "/console/topics/orders", "/console/subscriptions", id="mail", topic_id="orders")
    await post_form(console, "/console", "/console/logout")

    reader_id, reader_secret = await create_client_record(database_url, "topics:read subscriptions:read")
    await sign_in(console, reader_id, reader_secret)
    topic = await console.get("/console/topics/orders")
    assert topic.status_code == 200
    assert "Publish a test message" not in topic.text
    assert "New subscription" not in topic.text
    refused = await post_form(
        console, "/console/topics/orders", "/console/topics/orders/publish", payload="{}"
    )
    assert refused.status_code == 403
    assert "topics:publish" in refused.text
    sub = await console.get("/console/subscriptions/mail")
    assert "subscriptions:peek" in sub.text
    assert 'action="/console/subscriptions/mail"' not in sub.text
    assert (
        await post_form(console, "/console/subscriptions/mail", "/console/subscriptions/mail")
    ).status_code == 403
    assert (await console.get("/console/subscriptions/mail/dlq")).status_code == 403
    assert (await console.get("/console/clients")).status_code == 403
    assert (await console.get("/console/clients")).headers["content-type"].startswith("text/html")


async def test_clients_are_made_rotated_and_disabled_from_the_console(
    admin_console: tuple[httpx.AsyncClient, str], database_url: str
) -> None:
    console, admin_id = admin_console
    made = await post_form(
        console, "/console/clients", "/console/clients", name="reporter", scopes="topics:read"
    )
    assert made.status_code == 200
    new_id = re.search(r'id="new-client-id">([^<]+)<', made.text).group(1)  # type: ignore[union-attr]
    secret = re.search(r'id="new-client-secret">([^<]+)<', made.text).group(1)  # type: ignore[union-attr]
    token = await console.post("/oauth/token", json={"client_id": new_id, "client_secret": secret})
    assert token.status_code == 201
    listed = await console.get("/console/clients")
    assert listed.text.count("<small>(you)</small>") == 1  # the signed-in admin's own row
    assert "reporter" in listed.text
    assert secret not in listed.text

    rotated = await post_form(console, "/console/clients", f"/console/clients/{new_id}/secret")
    fresh = re.search(r'id="new-client-secret">([^<]+)<', rotated.text).group(1)  # type: ignore[union-attr]
    assert fresh != secret
    old = await console.post("/oauth/token", json={"client_id": new_id, "client_secret": secret})
    assert old.status_code == 401
    bearer = {"Authorization": f"Bearer {token.json()['access_token']}"}
    assert (await console.get("/topics", headers=bearer)).status_code == 401  # revoked by the rotation
    assert (
        await console.post("/oauth/token", json={"client_id": new_id, "client_secret": fresh})
    ).status_code == 201

    disabled = await post_form(
        console, "/console/clients", f"/console/clients/{new_id}/active", active="false"
    )
    assert disabled.status_code == 303
    assert (
        await console.post("/oauth/token", json={"client_id": new_id, "client_secret": fresh})
    ).status_code == 401
    # A narrower client may not rotate the admin's secret (the API's rule).
    await post_form(console, "/console", "/console/logout")
    manager_id, manager_secret = await create_client_record(database_url, "clients:read clients:update")
    await sign_in(console, manager_id, manager_secret)
    refused = await post_form(console, "/console/clients", f"/console/clients/{admin_id}/secret")
    assert refused.status_code == 403
    # A revoked session is signed out: the next page asks to sign in again.
    await post_form(console, "/console/clients", f"/console/clients/{manager_id}/secret")
    assert (await console.get("/console/clients")).status_code == 303


async def test_too_many_failed_sign_ins_say_when_to_try_again(
    make_api: ClientFactory, database_url: str
) -> None:
    console = await make_api(
        auth_enabled=True, auth_max_failed_attempts=2, auth_failed_attempts_window_seconds=60
    )
    client_id, secret = await create_client_record(database_url, "*")
    for _ in range(2):
        assert (await sign_in(console, client_id, "wrong")).status_code == 401
    refused = await sign_in(console, client_id, secret)
    assert refused.status_code == 429
    assert 0 < int(refused.headers["retry-after"]) <= 60  # as POST /oauth/token answers
    assert "too many failed attempts" in refused.text
