"""Push subscriptions over the API: configuration shown, secrets shown once, endpoints refused up front."""

from __future__ import annotations

from typing import Any

import httpx
import psycopg
import pytest
from standardwebhooks import Webhook

from tests.conftest import stored_push

PUSH = {
    "endpoint": "https://127.0.0.1:9/hook",
    "headers": {"Authorization": "Bearer r"},
    "timeout_seconds": 5,
}


async def _create(api: httpx.AsyncClient, **push: Any) -> httpx.Response:
    await api.post("/topics", json={"id": "t"})
    return await api.post("/subscriptions", json={"id": "s", "topic_id": "t", "push": {**PUSH, **push}})


async def test_a_push_subscription_shows_its_secret_once(make_api: Any) -> None:
    api = await make_api(push_allowed_hosts="127.0.0.1")
    created = await _create(api)
    assert created.status_code == 201, created.text
    push = created.json()["push"]
    assert push["endpoint"] == PUSH["endpoint"]
    assert push["headers"] == {"Authorization": "<hidden>"}
    assert (push["timeout_seconds"], push["max_concurrency"]) == (5, 10)
    assert push["secret"].startswith("whsec_")
    Webhook(push["secret"])  # a secret the Standard Webhooks library takes
    shown = (await api.get("/subscriptions/s")).json()["push"]
    assert shown["secret"] is None
    assert shown["endpoint"] == PUSH["endpoint"]
    listed = (await api.get("/subscriptions")).json()["data"][0]["push"]
    assert listed["secret"] is None


async def test_a_push_subscription_with_a_start_position_shows_its_secret_too(make_api: Any) -> None:
    """The answer is read again once the retained messages are added (for `backfilling`); the secret,
    which only the creating statement returns, stays in it."""
    api = await make_api(push_allowed_hosts="127.0.0.1")
    await api.post("/topics", json={"id": "t"})
    await api.post("/topics/t/publish", json={"messages": [{"payload": {"n": 1}}]})
    created = await api.post(
        "/subscriptions", json={"id": "s", "topic_id": "t", "start": "earliest", "push": PUSH}
    )
    assert created.status_code == 201, created.text
    assert created.json()["backfilling"] is False
    assert created.json()["push"]["secret"].startswith("whsec_")
    assert (await api.get("/subscriptions/s/metrics")).json()["available"] == 1


async def test_a_subscription_cannot_be_given_a_secret_of_its_callers_choosing(make_api: Any) -> None:
    api = await make_api(push_allowed_hosts="127.0.0.1")
    await api.post("/topics", json={"id": "t"})
    body = {"id": "s", "topic_id": "t", "push": PUSH, "push_secret": "whsec_chosen"}
    assert (await api.post("/subscriptions", json=body)).status_code == 422
    await api.post("/subscriptions", json={"id": "s", "topic_id": "t"})
    patched = await api.patch("/subscriptions/s", json={"push": PUSH, "push_secret": "whsec_chosen"})
    assert patched.status_code == 422


async def test_patching_keeps_the_secret_and_null_makes_it_pull_again(make_api: Any) -> None:
    api = await make_api(push_allowed_hosts="127.0.0.1")
    await api.post("/topics", json={"id": "t"})
    await api.post("/subscriptions", json={"id": "s", "topic_id": "t"})
    became = (await api.patch("/subscriptions/s", json={"push": PUSH})).json()["push"]
    assert became["secret"].startswith("whsec_")
    changed = await api.patch("/subscriptions/s", json={"push": {**PUSH, "max_concurrency": 3}})
    assert changed.json()["push"]["max_concurrency"] == 3
    assert changed.json()["push"]["secret"] is None  # kept, not shown again
    other = await api.patch("/subscriptions/s", json={"ack_deadline_seconds": 60})
    assert other.json()["push"]["max_concurrency"] == 3
    pulled = await api.patch("/subscriptions/s", json={"push": None})
    assert pulled.json()["push"] is None
    again = (await api.patch("/subscriptions/s", json={"push": PUSH})).json()["push"]
    assert again["secret"].startswith("whsec_")
    assert again["secret"] != became["secret"]


async def test_push_header_values_are_kept_for_the_requests_but_no_answer_shows_them(
    make_api: Any, bearer: Any, conn: psycopg.Connection
) -> None:
    # Tokens from `bearer` are signed with the key every app here shares.
    api = await make_api(auth_enabled=True, auth_client_cache_seconds=0, push_allowed_hosts="127.0.0.1")
    admin = await bearer("*")
    await api.post("/topics", json={"id": "t"}, headers=admin)
    push = {"endpoint": PUSH["endpoint"], "headers": {"Authorization": "Bearer r", "X-Tenant": "acme"}}
    created = await api.post("/subscriptions", json={"id": "s", "topic_id": "t", "push": push}, headers=admin)
    assert created.status_code == 201, created.text
    hidden = {"Authorization": "<hidden>", "X-Tenant": "<hidden>"}
    assert created.json()["push"]["headers"] == hidden
    # A client that may only read subscriptions (a dashboard) does not get the receiver's credentials.
    reader = await bearer("subscriptions:read")
    assert (await api.get("/subscriptions/s", headers=reader)).json()["push"]["headers"] == hidden
    listed = (await api.get("/subscriptions", headers=reader)).json()["data"]
    assert [s["push"]["headers"] for s in listed] == [hidden]
    patched = await api.patch("/subscriptions/s", json={"ack_deadline_seconds": 60}, headers=admin)
    assert patched.json()["push"]["headers"] == hidden
    # What the push-worker sends is what was given.
    assert stored_push(conn, "s")["headers"] == push["headers"]


async def test_a_hidden_header_value_written_back_is_refused_and_changes_nothing(
    make_api: Any, conn: psycopg.Connection
) -> None:
    api = await make_api(push_allowed_hosts="127.0.0.1")
    await _create(api)
    shown = (await api.get("/subscriptions/s")).json()["push"]
    written_back = {k: shown[k] for k in ("endpoint", "headers", "max_concurrency")} | {"timeout_seconds": 7}
    refused = await api.patch("/subscriptions/s", json={"push": written_back})
    assert refused.status_code == 422, refused.text
    assert refused.json()["detail"] == (
        "push.headers: give the value of Authorization; "
        "answers show every value as <hidden>, which is not one"
    )
    assert (await api.get("/subscriptions/s")).json()["push"]["timeout_seconds"] == 5
    assert stored_push(conn, "s")["headers"] == {"Authorization": "Bearer r"}
    made = await api.post("/subscriptions", json={"id": "s2", "topic_id": "t", "push": written_back})
    assert made.status_code == 422, made.text
    assert (await api.get("/subscriptions/s2")).status_code == 404


async def test_rotation_shows_the_new_secret_and_how_long_the_old_one_signs(make_api: Any) -> None:
    api = await make_api(push_allowed_hosts="127.0.0.1")
    first = (await _create(api)).json()["push"]["secret"]
    rotated = await api.post("/subscriptions/s/push/secret", json={"grace_seconds": 3600})
    assert rotated.status_code == 200, rotated.text
    push = rotated.json()["push"]
    assert push["secret"].startswith("whsec_")
    assert push["secret"] != first
    assert push["previous_secret_valid_until"] is not None
    assert (await api.get("/subscriptions/s")).json()["push"]["secret"] is None
    await api.post("/subscriptions", json={"id": "pull", "topic_id": "t"})
    refused = await api.post("/subscriptions/pull/push/secret", json={})
    assert refused.status_code == 422
    assert "not a push subscription" in refused.json()["detail"]
    assert (await api.post("/subscriptions/nope/push/secret", json={})).status_code == 404


@pytest.mark.parametrize(
    "endpoint",
    [
        "https://10.0.0.1/hook",
        "https://169.254.169.254/latest/meta-data",
        "https://[::1]/hook",
        "https://[::ffff:127.0.0.1]/hook",
        "https://[64:ff9b::a9fe:a9fe]/hook",
        "https://[2002:a9fe:a9fe::]/hook",
        "https://[fec0::1]/hook",
        "https://100.64.0.1/hook",
        "https://192.168.1.20/hook",
        "https://[fd00:ec2::254]/hook",
        "https://localhost/hook",
    ],
)
async def test_non_public_endpoints_are_refused_at_creation(api: httpx.AsyncClient, endpoint: str) -> None:
    # Refused by the check itself: an address literal is never connected to (and `localhost`
    # resolves from the hosts file), so no traffic leaves this machine.
    response = await _create(api, endpoint=endpoint)
    assert response.status_code == 422, response.text
    assert "not a public address" in response.json()["detail"]
    assert (await api.get("/subscriptions/s")).status_code == 404


@pytest.mark.parametrize(
    ("push", "named"),
    [
        ({"endpoint": "http://127.0.0.1/hook"}, "https://"),
        ({"endpoint": "ftp://127.0.0.1/hook"}, "endpoint"),
        ({"endpoint": "https://user:pw@127.0.0.1/hook"}, "credentials"),
        ({"endpoint": "https://127.0.0.1:99999/hook"}, "not a valid URL"),
        ({"headers": {"webhook-signature": "x"}}, "webhook-signature"),
        ({"headers": {"X-A": "line\nbreak"}}, "headers"),
        ({"headers": {"X-A": "café"}}, "headers"),
        ({"headers": {"X-A": " leading"}}, "headers"),
        ({"headers": {"X-A": "trailing "}}, "headers"),
        ({"headers": {"X-A": "\t"}}, "headers"),
        ({"endpoint": "https://a..b/hook"}, "not a valid host name"),
        ({"endpoint": "https://.test/hook"}, "not a valid host name"),
        ({"endpoint": "https://" + "a" * 64 + ".test/hook"}, "not a valid host name"),
        ({"endpoint": "https://[::1/hook"}, "not a valid URL"),
        ({"endpoint": "https://[zz]/hook"}, "not a valid URL"),
        ({"timeout_seconds": 0}, "timeout_seconds"),
        ({"max_concurrency": 101}, "max_concurrency"),
        ({"other": 1}, "other"),
    ],
)
async def test_bad_push_configurations_are_refused_naming_the_problem(
    make_api: Any, push: dict[str, Any], named: str
) -> None:
    api = await make_api(push_allowed_hosts="127.0.0.1")
    response = await _create(api, **push)
    assert response.status_code == 422, response.text
    assert named in str(response.json()["detail"])


async def test_the_allowed_hosts_and_http_settings_open_exactly_what_they_name(make_api: Any) -> None:
    api = await make_api(push_allow_http=True, push_allowed_hosts="localhost, 10.1.0.0/16")
    await api.post("/topics", json={"id": "t"})
    for n, endpoint in enumerate(["http://localhost:8080/a", "https://10.1.2.3/b"]):
        response = await api.post(
            "/subscriptions", json={"id": f"s{n}", "topic_id": "t", "push": {"endpoint": endpoint}}
        )
        assert response.status_code == 201, response.text
    refused = await api.post(
        "/subscriptions", json={"id": "s9", "topic_id": "t", "push": {"endpoint": "https://10.2.0.1/c"}}
    )
    assert refused.status_code == 422


async def test_push_changes_need_the_update_scope(
    secured: httpx.AsyncClient, bearer: Any, database_url: str
) -> None:
    admin = await bearer("*")
    await secured.post("/topics", json={"id": "t"}, headers=admin)
    await secured.post("/subscriptions", json={"id": "s", "topic_id": "t"}, headers=admin)
    reader = await bearer("subscriptions:read subscriptions:consume")
    denied = await secured.post("/subscriptions/s/push/secret", json={}, headers=reader)
    assert denied.status_code == 403
    assert "subscriptions:update" in denied.json()["detail"]
