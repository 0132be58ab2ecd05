"""Who is using the console, and proof that a form was sent from the console itself.

With auth on, signing in exchanges client credentials for an access token (the
same exchange as POST /oauth/token); the token lives in an HttpOnly,
SameSite=Strict cookie and is checked on every request exactly as a bearer
token is, so a revoked client is signed out within the revocation cache's
lifetime. With auth off the console is open, like the API (the server then
serves loopback addresses only, unless told it is insecure).

Every form carries a CSRF token that must equal the one in the console's own
HttpOnly, SameSite=Strict cookie (a page elsewhere can neither read that
cookie nor make the browser send it), and a form sent with an `Origin` header
from another origin is refused as well.
"""

from __future__ import annotations

import hmac
import secrets
from urllib.parse import parse_qs

from starlette.requests import Request
from starlette.responses import Response

from fastpubsub.api.deps import Principal, authenticate
from fastpubsub.exceptions import AuthenticationError, InvalidInputError, PermissionDeniedError

TOKEN_COOKIE = "fastpubsub_console_token"  # noqa: S105  # a cookie name, not a secret
CSRF_COOKIE = "fastpubsub_console_csrf"
CSRF_FIELD = "csrf_token"
COOKIE_PATH = "/console"
# Console forms are small: a test message or a filter, well under the API's 64 KiB for a body.
MAX_FORM_BYTES = 65536


class NotSignedIn(AuthenticationError):
    """Sign in to use the console."""


def csrf_token(request: Request) -> str:
    """The CSRF token of this browser (a new one if it has none yet; `remember_csrf` stores it)."""
    token: str | None = request.scope.setdefault("state", {}).get("console_csrf")
    if token is None:
        token = request.cookies.get(CSRF_COOKIE) or secrets.token_urlsafe(32)
        request.scope["state"]["console_csrf"] = token
    return token


def is_secure(request: Request) -> bool:
    return request.url.scheme == "https"


def remember_csrf(request: Request, response: Response) -> None:
    """Set the CSRF cookie when this browser had none (or had it replaced at sign-in)."""
    token = csrf_token(request)
    if request.cookies.get(CSRF_COOKIE) != token:
        response.set_cookie(
            CSRF_COOKIE,
            token,
            path=COOKIE_PATH,
            httponly=True,
            samesite="strict",
            secure=is_secure(request),
        )


def sign_in(request: Request, response: Response, access_token: str, lifetime: int) -> None:
    """Keep the access token in the cookie, and start a new CSRF token with the new session."""
    response.set_cookie(
        TOKEN_COOKIE,
        access_token,
        max_age=lifetime,
        path=COOKIE_PATH,
        httponly=True,
        samesite="strict",
        secure=is_secure(request),
    )
    request.scope.setdefault("state", {})["console_csrf"] = secrets.token_urlsafe(32)
    remember_csrf(request, response)


def sign_out(response: Response) -> None:
    response.delete_cookie(TOKEN_COOKIE, path=COOKIE_PATH, httponly=True, samesite="strict")


async def principal(request: Request) -> Principal:
    """The signed-in client (everyone is admin with auth off); NotSignedIn without a usable token."""
    if not request.app.state.settings.auth_enabled:
        return await authenticate(request.app.state, None)
    token = request.cookies.get(TOKEN_COOKIE)
    if not token:  # never signed in, or the cookie ended with the token's lifetime
        raise NotSignedIn("you are not signed in, or your session has ended: sign in again")
    try:
        return await authenticate(request.app.state, f"Bearer {token}")
    except AuthenticationError as exc:
        raise NotSignedIn(f"{exc}: sign in again") from exc


def _same_origin(request: Request) -> bool:
    origin = request.headers.get("origin")
    if origin is None:  # older browsers send none on same-origin forms; the token is the check then
        return True
    host = request.headers.get("host", "")
    return origin in (f"http://{host}", f"https://{host}")


async def form(request: Request) -> dict[str, list[str]]:
    """The form a console page sent, once its CSRF token and origin are checked (403 otherwise)."""
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type != "application/x-www-form-urlencoded":
        raise InvalidInputError("the console takes forms (application/x-www-form-urlencoded)")
    body = await request.body()
    if len(body) > MAX_FORM_BYTES:
        raise InvalidInputError(f"a console form is at most {MAX_FORM_BYTES} bytes")
    try:
        fields = parse_qs(body.decode("utf-8"), keep_blank_values=True)
    except (UnicodeDecodeError, ValueError) as exc:
        raise InvalidInputError("the form is malformed") from exc
    sent = fields.get(CSRF_FIELD, [""])[0]
    expected = request.cookies.get(CSRF_COOKIE, "")
    if not expected or not hmac.compare_digest(sent.encode(), expected.encode()):
        raise PermissionDeniedError(
            "the form's CSRF token does not match this browser's: reload the page and send it again"
        )
    if not _same_origin(request):
        raise PermissionDeniedError("the form was sent from another site")
    return fields
