"""One place that turns fastpubsub errors into HTTP answers: JSON with `detail`, never a traceback."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import BaseRoute, Route

from fastpubsub.exceptions import (
    AlreadyExistsError,
    AuthenticationError,
    BacklogFullError,
    ConfigurationError,
    DatabaseUnavailableError,
    FastPubSubError,
    InvalidInputError,
    NotFoundError,
    PayloadTooLargeError,
    PermissionDeniedError,
    StatementTimeoutError,
)
from fastpubsub.logs import one_line, request_id

log = logging.getLogger(__name__)

STATUS = {
    NotFoundError: 404,
    AlreadyExistsError: 409,
    InvalidInputError: 422,
    PayloadTooLargeError: 413,
    BacklogFullError: 429,
    DatabaseUnavailableError: 503,
    StatementTimeoutError: 503,
    # The server's own set-up is wrong (e.g. the database is not migrated): not the client's doing.
    ConfigurationError: 503,
    AuthenticationError: 401,
    PermissionDeniedError: 403,
}

DESCRIPTIONS = {
    401: "Missing, invalid, expired or revoked access token",
    403: "The token's scopes do not allow this",
    404: "No such object",
    409: "An object with this id already exists",
    413: "A message or the request is larger than the configured limit",
    415: "Not JSON: with auth off, POST, PUT and PATCH must send Content-Type: application/json",
    422: "Invalid input",
    429: "A subscription of the topic is full (max_backlog, backlog_policy reject): nothing was published",
    503: "The database is unreachable; retry shortly",
}


def error_responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI entries for the error answers an endpoint can give (503 always can)."""
    from fastpubsub.api.schemas import ErrorBody

    return {code: {"model": ErrorBody, "description": DESCRIPTIONS[code]} for code in (*codes, 503)}


def document_shared_answers(openapi: dict[str, Any]) -> None:
    """Add the answers every operation of a kind can give: 413 with a body, 415 for writes (auth off)."""
    for operations in openapi.get("paths", {}).values():
        for method, operation in operations.items():
            if not isinstance(operation, dict):
                continue
            codes = [413] if "requestBody" in operation else []
            if method in ("post", "put", "patch"):
                codes.append(415)
            for code in codes:
                operation.setdefault("responses", {}).setdefault(
                    str(code),
                    {
                        "description": DESCRIPTIONS[code],
                        "content": {
                            "application/json": {"schema": {"$ref": "#/components/schemas/ErrorBody"}}
                        },
                    },
                )


def document_models(openapi: dict[str, Any], *models: type[BaseModel]) -> None:
    """Put models that routes read themselves (their bodies are named by $ref) among the components."""
    schemas = openapi.setdefault("components", {}).setdefault("schemas", {})
    for model in models:
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        for name, definition in schema.pop("$defs", {}).items():
            schemas.setdefault(name, definition)
        schemas.setdefault(model.__name__, schema)


def status_for(exc: FastPubSubError) -> int:
    for kind, status in STATUS.items():
        if isinstance(exc, kind):
            return status
    return 500


def error_response(status: int, detail: Any, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"detail": detail}, status_code=status, headers=headers)


async def _fastpubsub_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, FastPubSubError)
    status = status_for(exc)
    headers = None
    if status == 401:
        headers = {"WWW-Authenticate": 'Bearer error="invalid_token"'}
    elif status == 503:
        headers = {"Retry-After": "1"}
        # One line per failure: an outage fails every request, and each would
        # otherwise log a driver message of several lines. The traceback is at debug.
        cause = exc.__cause__ or exc
        log.warning("%s %s answered 503: %s", request.method, request.url.path, one_line(cause))
        log.debug("answered 503", exc_info=exc)
    elif status == 500:
        log.error("unexpected error", exc_info=exc)
        return error_response(500, "internal error; see the server log for request " + str(request_id.get()))
    return error_response(status, exc.message, headers)


def validation_problems(errors: Sequence[Any]) -> list[dict[str, Any]]:
    """Validation errors as the API reports them: where, what and which kind (never the input)."""
    return [{key: error[key] for key in ("loc", "msg", "type") if key in error} for error in errors]


def validation_text(errors: Sequence[Any], whole: str = "") -> str:
    """Validation errors in one line: `where: what` each, `whole` where the input as a whole is at fault."""
    return "; ".join(f"{'.'.join(map(str, error['loc'])) or whole}: {error['msg']}" for error in errors)


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    return error_response(422, validation_problems(exc.errors()))


class AllowedMethods:
    """Every method some route serves a path with: a 405's Allow header names them all.

    (The router names only the methods of the first route whose path matched.)
    """

    def __init__(self, routes: Iterable[BaseRoute]) -> None:
        self._routes = [
            (route.path_regex, frozenset(route.methods))
            for route in routes
            if isinstance(route, Route | APIRoute) and route.methods
        ]

    def header(self, path: str) -> str:
        methods: set[str] = set()
        for regex, route_methods in self._routes:
            if regex.match(path):
                methods |= route_methods
        return ", ".join(sorted(methods))


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    if exc.status_code == 405:
        allowed: AllowedMethods = request.app.state.allowed_methods
        return error_response(405, exc.detail, {"Allow": allowed.header(request.url.path)})
    if exc.status_code == 400 and isinstance(exc.__cause__, ValueError | RecursionError):
        # FastAPI answers 400 when the JSON body is not UTF-8 (UnicodeDecodeError)
        # or nested too deeply to parse: invalid input like any other bad JSON.
        problem = {
            "loc": ["body"],
            "msg": f"the body is not valid JSON: {exc.__cause__}",
            "type": "json_invalid",
        }
        return error_response(422, [problem])
    return error_response(exc.status_code, exc.detail, getattr(exc, "headers", None))


async def _unexpected_error(request: Request, exc: Exception) -> JSONResponse:
    log.error("unexpected error", exc_info=exc)
    return error_response(500, "internal error; see the server log for request " + str(request_id.get()))


async def response_for(request: Request, exc: Exception) -> JSONResponse:
    """The error response the application's handlers give for `exc` (for code outside the router)."""
    if isinstance(exc, FastPubSubError):
        return await _fastpubsub_error(request, exc)
    if isinstance(exc, StarletteHTTPException):
        return await _http_error(request, exc)
    return await _unexpected_error(request, exc)


def install(app: FastAPI) -> None:
    app.add_exception_handler(FastPubSubError, _fastpubsub_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected_error)
