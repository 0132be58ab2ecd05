"""POST /oauth/token: the seed's JSON body, and the RFC 6749 client-credentials grant."""

from __future__ import annotations

import asyncio
import base64
import binascii
from urllib.parse import parse_qs, unquote_plus
from uuid import UUID

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from fastpubsub import auth
from fastpubsub.api.deps import SettingsDep
from fastpubsub.api.errors import error_response, validation_problems
from fastpubsub.api.schemas import ErrorBody, TokenOut, TokenRequest
from fastpubsub.api.throttle import FailedAttempts
from fastpubsub.db import Database
from fastpubsub.exceptions import InvalidInputError, PermissionDeniedError
from fastpubsub.settings import Settings

router = APIRouter(tags=["auth"])

_UNSUPPORTED_GRANT = "only grant_type=client_credentials is supported"
_NO_STORE = {"Cache-Control": "no-store", "Pragma": "no-cache"}
_TOKEN_BODY = {
    "required": True,
    "content": {
        "application/json": {
            "schema": {"$ref": "#/components/schemas/TokenRequest"},
            "example": {"client_id": "550e8400-e29b-41d4-a716-446655440000", "client_secret": "..."},
        },
        "application/x-www-form-urlencoded": {
            "schema": {
                "type": "object",
                "required": ["grant_type"],
                "properties": {
                    "grant_type": {"type": "string", "enum": ["client_credentials"]},
                    "client_id": {"type": "string", "description": "Or use HTTP Basic"},
                    "client_secret": {"type": "string", "description": "Or use HTTP Basic"},
                    "scope": {"type": "string", "description": "Optional subset of the client's scopes"},
                },
            }
        },
    },
}


class OAuthError(Exception):
    """An RFC 6749 error answer."""

    def __init__(
        self, status: int, error: str, description: str, basic: bool = False, retry_after: int = 0
    ) -> None:
        self.status, self.error, self.description, self.basic = status, error, description, basic
        self.retry_after = retry_after


def _oauth_error(exc: OAuthError) -> JSONResponse:
    headers = dict(_NO_STORE)
    if exc.status == 401:
        headers["WWW-Authenticate"] = 'Basic realm="fastpubsub"' if exc.basic else 'Bearer realm="fastpubsub"'
    if exc.retry_after:
        headers["Retry-After"] = str(exc.retry_after)
    body = {"error": exc.error, "error_description": exc.description, "detail": exc.description}
    return JSONResponse(body, status_code=exc.status, headers=headers)


def _basic_credentials(header: str) -> tuple[str, str] | None:
    scheme, _, encoded = header.partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        decoded = base64.b64decode(encoded.strip(), validate=True).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError) as exc:
        raise OAuthError(401, "invalid_client", "malformed HTTP Basic credentials", basic=True) from exc
    client_id, sep, secret = decoded.partition(":")
    if not sep:
        raise OAuthError(401, "invalid_client", "malformed HTTP Basic credentials", basic=True)
    # RFC 6749 2.3.1: both parts are form-urlencoded before Basic encoding.
    return unquote_plus(client_id), unquote_plus(secret)


async def exchange_credentials(
    request: Request, client_id: str, secret: str, requested: str | None, basic: bool
) -> TokenOut:
    """A token for a client's credentials, or OAuthError (throttled per address and client).

    The web console signs in through this too, so that it answers and throttles as /oauth/token does.
    """
    database: Database = request.app.state.database
    settings: Settings = request.app.state.settings
    failures: FailedAttempts = request.app.state.token_failures
    keys = (("address", request.client.host if request.client else ""), ("client", client_id))
    wait = failures.retry_after(*keys)
    if wait:
        raise OAuthError(
            429,
            "invalid_request",
            f"too many failed attempts from this address or for this client; retry in {wait} s",
            retry_after=wait,
        )
    invalid = OAuthError(401, "invalid_client", "invalid client credentials", basic=basic)
    try:
        key = UUID(client_id)
    except ValueError:
        key = None
    credentials = await database.get_client_credentials(key) if key is not None else None
    usable = credentials is not None and credentials.client.is_active
    # The hash check runs whether or not the client exists, so that an unknown
    # client, a disabled one and a wrong secret take the same time and answer.
    secret_hash = credentials.secret_hash if usable and credentials is not None else None
    if not await asyncio.to_thread(auth.verify_secret, secret, secret_hash) or credentials is None:
        failures.failed(*keys)
        raise invalid
    failures.forget(keys[1])
    granted = auth.parse_scopes(credentials.client.scopes)
    scopes = granted
    if requested:
        try:
            scopes = auth.parse_scopes(requested)
            auth.require_covered(granted, scopes)
        except (InvalidInputError, PermissionDeniedError) as exc:
            raise OAuthError(400, "invalid_scope", str(exc)) from exc
    token, lifetime = auth.issue_token(
        settings, credentials.client.id, scopes, credentials.client.token_version
    )
    return TokenOut(access_token=token, expires_in=lifetime, scope=" ".join(scopes))


@router.post(
    "/oauth/token",
    summary="Exchange client credentials for an access token",
    description=(
        "Two forms:\n\n"
        "* the JSON body `{client_id, client_secret}` (with, optionally, "
        '`"grant_type": "client_credentials"`) answers **201**;\n'
        "* the OAuth2 form `grant_type=client_credentials` (RFC 6749 §4.4), with the credentials in "
        "the form or in HTTP Basic, answers **200**, with RFC 6749 error bodies "
        '(`{"error": "invalid_client"}`). This is what the Swagger UI "Authorize" dialog sends.'
    ),
    status_code=201,
    openapi_extra={"requestBody": _TOKEN_BODY},
    responses={
        200: {"model": TokenOut, "description": "Token (OAuth2 form request)"},
        201: {"model": TokenOut, "description": "Token (JSON request)"},
        400: {"model": ErrorBody, "description": "invalid_request, unsupported_grant_type or invalid_scope"},
        401: {"model": ErrorBody, "description": "invalid_client: unknown client, disabled or wrong secret"},
        413: {"model": ErrorBody, "description": "The body is larger than 8 KiB"},
        415: {"model": ErrorBody, "description": "Neither JSON nor a form"},
        422: {"model": ErrorBody, "description": "Invalid JSON body"},
        429: {
            "model": ErrorBody,
            "description": "Too many failed attempts from this address or for this client: retry after "
            "`Retry-After` seconds",
        },
        503: {"model": ErrorBody, "description": "The database is unreachable"},
    },
)
async def issue_token(request: Request, settings: SettingsDep) -> JSONResponse:
    if not settings.auth_enabled:
        raise InvalidInputError("authentication is disabled on this server (FASTPUBSUB_AUTH_ENABLED=false)")
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    body = await request.body()
    try:
        if content_type == "application/x-www-form-urlencoded":
            return await _form_grant(request, body)
        if content_type in ("application/json", ""):
            try:
                data = TokenRequest.model_validate_json(body or b"null")
            except ValidationError as exc:
                return error_response(422, validation_problems(exc.errors(include_url=False)))
            if data.grant_type is not None and data.grant_type != "client_credentials":
                raise OAuthError(400, "unsupported_grant_type", _UNSUPPORTED_GRANT)
            token = await exchange_credentials(
                request, str(data.client_id), data.client_secret, None, basic=False
            )
            return JSONResponse(token.model_dump(), status_code=201, headers=_NO_STORE)
        raise OAuthError(415, "invalid_request", "send JSON or application/x-www-form-urlencoded")
    except OAuthError as exc:
        return _oauth_error(exc)


async def _form_grant(request: Request, body: bytes) -> JSONResponse:
    try:
        form = parse_qs(body.decode("utf-8"), keep_blank_values=True, strict_parsing=bool(body))
    except (UnicodeDecodeError, ValueError) as exc:
        raise OAuthError(400, "invalid_request", "the form body is malformed") from exc
    if any(len(values) > 1 for values in form.values()):
        raise OAuthError(400, "invalid_request", "a parameter was given more than once")
    fields = {key: values[0] for key, values in form.items()}
    grant_type = fields.get("grant_type")
    if not grant_type:
        raise OAuthError(400, "invalid_request", "grant_type is required")
    if grant_type != "client_credentials":
        raise OAuthError(400, "unsupported_grant_type", _UNSUPPORTED_GRANT)
    basic = _basic_credentials(request.headers.get("authorization", ""))
    in_body = fields.get("client_id") is not None or fields.get("client_secret") is not None
    if basic and in_body:
        raise OAuthError(400, "invalid_request", "send the client credentials once: in Basic or in the body")
    if basic:
        client_id, secret = basic
    elif fields.get("client_id") and fields.get("client_secret"):
        client_id, secret = fields["client_id"], fields["client_secret"]
    else:
        raise OAuthError(401, "invalid_client", "client credentials are required", basic=True)
    token = await exchange_credentials(
        request, client_id, secret, fields.get("scope"), basic=basic is not None
    )
    return JSONResponse(token.model_dump(), status_code=200, headers=_NO_STORE)
