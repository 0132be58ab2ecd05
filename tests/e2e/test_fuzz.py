"""The whole OpenAPI document, fuzzed against the real server (Schemathesis), auth on and off.

Every operation gets requests generated from its schema (valid ones, and ones
that break it); no answer may be a server error, and every answer must be
documented: its status, content type, headers and body schema. The hostile
cases the generator is unlikely to find (JSON nested deep, a million-field
form, malformed tokens) are sent explicitly next to them.

Bounded: EXAMPLES requests per operation and mode, no shrinking, a fixed seed.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Any

import httpx
import jwt
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    negative_data_rejection,
    not_a_server_error,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from schemathesis.config import SchemathesisConfig

from tests.e2e.conftest import Server, base_env, cli

pytestmark = pytest.mark.slow

EXAMPLES = 25
# A stream that reaches a subscription never ends by itself: its errors are among the explicit cases.
NOT_FUZZED = {"GET /subscriptions/{subscription_id}/stream"}
# Data that breaks the schema must be refused with a 4xx: 413 (a body over a limit) included.
CONFIG = SchemathesisConfig.from_dict(
    {
        "checks": {
            "negative_data_rejection": {
                "expected-statuses": ["400", "401", "403", "404", "405", "409", "413", "415", "422", "429"]
            }
        }
    }
)
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
]


def start(
    database_url: str, run_server: Callable[..., Server], auth_enabled: bool
) -> tuple[Server, dict[str, str]]:
    if not auth_enabled:
        return run_server(base_env(database_url), workers=1), {}
    key = re.search(r"^new_secret=(\S+)$", cli(base_env(database_url), "generate-secret-key"), re.M)
    assert key is not None
    env = base_env(database_url, auth_enabled="true", auth_secret_key=key.group(1))
    created = cli(env, "create-client", "fuzz", "*", "true")
    values = dict(line.split("=", 1) for line in created.split())
    server = run_server(env, workers=1)
    with server.client() as http:
        token = http.post(
            "/oauth/token", json={"client_id": values["client_id"], "client_secret": values["client_secret"]}
        ).json()["access_token"]
    return server, {"Authorization": f"Bearer {token}"}


def fuzz(
    operation: Any, mode: GenerationMode, url: str, headers: dict[str, str], failures: list[str]
) -> None:
    """Send EXAMPLES generated requests to one operation; describe every failed check in `failures`."""

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        derandomize=True,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=operation.as_strategy(generation_mode=mode))
    def run(case: Any) -> None:
        response = case.call(base_url=url, headers=headers, timeout=40)
        try:
            case.validate_response(
                response,
                checks=[*CHECKS, negative_data_rejection] if mode is GenerationMode.NEGATIVE else CHECKS,
            )
        except Exception as exc:  # every failing check, described
            failures.append(f"{operation.label} ({mode.value}): {' '.join(str(exc).split())[:600]}")

    try:
        run()
    except Unsatisfiable:
        assert mode is GenerationMode.NEGATIVE, operation.label  # no parameter to break (e.g. /liveness)


@pytest.mark.parametrize("auth_enabled", [False, True], ids=["auth-off", "auth-on"])
def test_generated_requests_get_documented_answers_and_never_a_server_error(
    database_url: str, run_server: Callable[..., Server], auth_enabled: bool
) -> None:
    server, headers = start(database_url, run_server, auth_enabled)
    with server.client() as http:
        document = http.get("/openapi.json").json()
    schema = schemathesis.openapi.from_dict(document, config=CONFIG)
    failures: list[str] = []
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 25
    for operation in operations:
        if operation.label in NOT_FUZZED:
            continue
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            fuzz(operation, mode, server.url, headers, failures)
    assert failures == [], "\n".join(failures[:20])


# -- hostile requests, explicitly -------------------------------------------------------------------
def forged(key: str, **claims: Any) -> str:
    now = int(time.time())
    base = {"iss": "fastpubsub", "sub": "0190b5a0-0000-7000-8000-000000000001", "scope": "*", "ver": 1}
    return jwt.encode({**base, "iat": now, "exp": now + 600, **claims}, key, algorithm="HS256")


def test_hostile_requests_get_clear_4xx_answers(database_url: str, run_server: Callable[..., Server]) -> None:
    server, headers = start(database_url, run_server, auth_enabled=True)
    key = server.env["FASTPUBSUB_AUTH_SECRET_KEY"]
    json_type = {"content-type": "application/json"}
    with server.client(headers=headers) as http:
        http.post("/topics", json={"id": "t"})
        http.post("/subscriptions", json={"id": "s", "topic_id": "t"})
        deep = b"[" * 100_000 + b"]" * 100_000
        nested = b'{"x":' * 1_100 + b"{}" + b"}" * 1_100
        cases: list[tuple[str, str, bytes, dict[str, str], int]] = [
            ("POST", "/topics/t/messages", b"[" + nested + b"]", json_type, 422),
            ("POST", "/topics/t/messages", deep, json_type, 422),
            ("POST", "/topics/t/publish", b'{"messages": [{"payload": ' + nested + b"}]}", json_type, 422),
            (
                "POST",
                "/topics/t/publish",
                b'{"messages": [{"payload": {"a": ' + deep + b"}}]}",
                json_type,
                422,
            ),
            (
                "POST",
                "/subscriptions",
                b'{"id": "x", "topic_id": "t", "filter": ' + deep[:40_000] + b"}",
                json_type,
                422,
            ),
            (
                "POST",
                "/oauth/token",
                b"&".join(b"f%06d=v" % i for i in range(1_000_000)),
                {"content-type": "application/x-www-form-urlencoded"},
                413,
            ),
            ("GET", "/subscriptions/s/stream?consumer_id=%00", b"", {}, 422),
            ("GET", "/subscriptions/nope/stream?consumer_id=w", b"", {}, 404),
            ("GET", "/subscriptions/s/stream?consumer_id=w&max_in_flight=0", b"", {}, 422),
        ]
        for method, path, body, extra, status in cases:
            response = http.request(method, path, content=body, headers=extra)
            assert response.status_code == status, (method, path, response.text[:300])
            assert "detail" in response.json()
    for token in (
        forged(key, ver=float("inf")),
        forged(key, ver="1"),
        forged(key, scope=["*"]),
        forged("another-key-" + "x" * 60),
        forged(key, exp=int(time.time()) - 10),
        "not.a.token",
        "a" * 5000,
    ):
        response = httpx.get(f"{server.url}/topics", headers={"Authorization": f"Bearer {token}"}, timeout=10)
        assert response.status_code == 401, (token[:40], response.text)
        assert response.headers["www-authenticate"].startswith("Bearer")
