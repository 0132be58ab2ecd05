"""What every request must pass before its body is read: a token (auth on), a JSON write (auth off).

With auth on, a request for anything but the public paths (probes, the token
endpoint, the documentation) is authenticated here, from its headers alone:
a request without a valid token is answered 401 without its body being read
or parsed, whatever its size. The principal goes on to the routes and the
hot-path middleware in the request's state.

With auth off, anyone who can reach the server may do anything (which is why
it serves only loopback addresses then, unless told otherwise). What is left
to guard against is a web page making a visitor's browser send requests: a
browser sends a cross-site POST without asking first only with a form or text
content type, so POST, PUT and PATCH must say `Content-Type: application/json`
(415 otherwise; the OAuth2 form endpoint excepted, it needs auth on anyway, and
the console's forms, which carry a CSRF token instead).
DELETE never goes cross-site without the browser asking the server first.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from fastpubsub.api import errors
from fastpubsub.api.deps import PRINCIPAL_STATE, authenticate
from fastpubsub.api.docs import ASSETS, OAUTH2_REDIRECT
from fastpubsub.api.middleware import TOKEN_PATH, send_json_error
from fastpubsub.console import is_console
from fastpubsub.exceptions import FastPubSubError
from fastpubsub.settings import Settings

PUBLIC_PATHS = frozenset(
    {"/liveness", "/readiness", TOKEN_PATH, "/openapi.json", "/docs", OAUTH2_REDIRECT, "/redoc"}
)
_WRITES = frozenset({"POST", "PUT", "PATCH"})


def is_public(path: str) -> bool:
    """Whether `path` is served without a bearer token when auth is on.

    The console is: it signs its users in with a cookie and checks a CSRF token
    on every form (fastpubsub/console/session.py).
    """
    return path in PUBLIC_PATHS or path.startswith(ASSETS + "/") or is_console(path)


def is_json(scope: Scope) -> bool:
    """Whether the request says its body is JSON (`application/json`, parameters allowed)."""
    content_type = next((v for k, v in scope["headers"] if k == b"content-type"), b"")
    return content_type.split(b";", 1)[0].strip().lower() == b"application/json"


class Gate:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not await self._admit(scope, receive, send):
            return
        await self.app(scope, receive, send)

    @staticmethod
    async def _admit(scope: Scope, receive: Receive, send: Send) -> bool:
        """Let the request on (True), or answer it here (False)."""
        settings: Settings = scope["app"].state.settings
        path: str = scope["path"]
        if settings.auth_enabled:
            if not is_public(path):
                request = Request(scope, receive)
                authorization = next((v for k, v in scope["headers"] if k == b"authorization"), None)
                try:
                    principal = await authenticate(
                        request.app.state, authorization.decode("latin-1") if authorization else None
                    )
                except FastPubSubError as exc:
                    await (await errors.response_for(request, exc))(scope, receive, send)
                    return False
                scope.setdefault("state", {})[PRINCIPAL_STATE] = principal
        elif (
            scope["method"] in _WRITES and path != TOKEN_PATH and not is_console(path) and not is_json(scope)
        ):
            await send_json_error(
                send,
                415,
                "with auth off, POST, PUT and PATCH requests must be sent with "
                "Content-Type: application/json (so that no web page can make a browser send them)",
            )
            return False
        return True
