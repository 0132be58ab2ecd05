"""The HTTP layer of the SDK: credentials, retries and error answers, shared by every call.

One `Connection` per client: an httpx.AsyncClient with the base URL, the
access token (a static one, or OAuth2 client credentials fetched from
`/oauth/token`, cached and renewed before it runs out), and retries with
jittered exponential backoff. A request is retried when it never reached the
server (connection refused, no free connection), and, when the call is
idempotent, also when the answer was lost or was 503 (database unavailable).
"""

from __future__ import annotations

import asyncio
import random
import re
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote
from uuid import UUID

import httpx

from fastpubsub import __version__, jsoncodec
from fastpubsub.api.schemas import ID_DESCRIPTION, ID_PATTERN
from fastpubsub.client import errors

USER_AGENT = f"fastpubsub-python/{__version__}"
# Transport errors after which the server cannot have seen the request.
_NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)
# What RFC 6750 allows a bearer token to be (b64token).
_BEARER_TOKEN = re.compile(r"[A-Za-z0-9\-._~+/]+=*")
# A route's name or an id (route names are ids too).
_SEGMENT = re.compile(ID_PATTERN)


@dataclass(frozen=True)
class Retry:
    """How often and how patiently a retryable request is tried again.

    The wait before try n (from 1) is drawn between half and all of
    min(backoff_max, backoff_min * 2**(n-1)) seconds, so that many clients
    retrying at once spread out.
    """

    attempts: int = 6
    backoff_min: float = 0.1
    backoff_max: float = 5.0

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError("attempts must be at least 1")
        if not 0 <= self.backoff_min <= self.backoff_max:
            raise ValueError("backoff_min must be between 0 and backoff_max")

    def delay(self, retry: int) -> float:
        """Seconds to wait before retry number `retry` (0 for the first)."""
        ceiling = min(self.backoff_max, self.backoff_min * 2.0**retry)
        return ceiling / 2 + random.uniform(0, ceiling / 2)  # noqa: S311 - jitter, not a secret


def path(*parts: object) -> str:
    """A URL path from segments: names of routes and ids, each checked to be one.

    An id that is not one could name another route ("" or "a/.." would
    reach the list, or nothing): it is refused here, as the server would refuse it.
    """
    segments = [str(part) for part in parts]
    for segment in segments:
        if not _SEGMENT.match(segment):
            raise errors.InvalidInputError(f'invalid id "{segment}": ids are {ID_DESCRIPTION}')
    return "/" + "/".join(quote(segment, safe="") for segment in segments)


class _Token:
    """An access token from /oauth/token and when to fetch the next one (monotonic clock)."""

    def __init__(self, value: str, renew_at: float) -> None:
        self.value = value
        self.renew_at = renew_at


class Credentials:
    """Where the bearer token comes from: none, a fixed one, or OAuth2 client credentials."""

    def __init__(
        self,
        *,
        token: str | None = None,
        client_id: str | None = None,
        client_secret: str | None = None,
        refresh_margin: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if token is not None and (client_id is not None or client_secret is not None):
            raise ValueError("give a token or client credentials, not both")
        if (client_id is None) != (client_secret is None):
            raise ValueError("client_id and client_secret go together")
        if refresh_margin is not None and refresh_margin < 0:
            raise ValueError("refresh_margin must not be negative")
        if token is not None and not _BEARER_TOKEN.fullmatch(token):
            # Never echoed: it is a secret, and httpx would put it in its error.
            raise ValueError(
                "the token has a character a bearer token cannot hold (a space or a line break "
                "copied with it?): only letters, digits, -._~+/ and = at its end"
            )
        if client_id is not None:
            try:
                UUID(client_id)
            except ValueError:
                raise ValueError(
                    f'client_id "{client_id}" is not a UUID (create-client prints one)'
                ) from None
        self.static = token
        self.client_id = client_id
        self.client_secret = client_secret
        self.refresh_margin = refresh_margin
        self.clock = clock
        self.fetched = 0  # tokens fetched so far
        self._token: _Token | None = None
        self._lock = asyncio.Lock()

    @property
    def renewable(self) -> bool:
        return self.client_id is not None

    def renew_at(self, expires_in: float) -> float:
        """When a token valid for `expires_in` seconds from now should be replaced."""
        margin = self.refresh_margin if self.refresh_margin is not None else min(60.0, expires_in / 10)
        return self.clock() + max(expires_in - margin, 0.0)

    def current(self) -> str | None:
        """The token to send now, if one is known and not due for renewal."""
        if self.static is not None:
            return self.static
        token = self._token
        if token is None or self.clock() >= token.renew_at:
            return None
        return token.value

    async def token(self, fetch: Callable[[dict[str, str]], Awaitable[Any]]) -> str | None:
        """The token to send (fetched or renewed first when due); None without auth.

        `fetch` posts the client credentials to /oauth/token and returns the answer.
        """
        if (token := self.current()) is not None or self.client_id is None or self.client_secret is None:
            return token
        async with self._lock:
            if (token := self.current()) is not None:
                return token  # another task renewed it while this one waited
            answer = await fetch({"client_id": self.client_id, "client_secret": self.client_secret})
            token = str(answer["access_token"])
            self._token = _Token(token, self.renew_at(float(answer["expires_in"])))
            self.fetched += 1
            return token

    def forget(self, value: str) -> None:
        """The server refused this token: fetch another one next time."""
        if self._token is not None and self._token.value == value:
            self._token = None


class Connection:
    """Requests to one fastpubsub server with credentials and retries (see the module docstring)."""

    def __init__(
        self,
        url: str,
        credentials: Credentials,
        *,
        timeout: float,
        retry: Retry,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.credentials = credentials
        self.retry = retry
        self.timeout = timeout
        self.http = httpx.AsyncClient(
            base_url=url.rstrip("/"),
            timeout=timeout,
            transport=transport,
            headers={"User-Agent": USER_AGENT},
            # Enough connections for a subscriber's stream, its settlements and lease
            # extensions, and a publisher's batches, side by side.
            limits=httpx.Limits(max_connections=100, max_keepalive_connections=20),
        )

    async def aclose(self) -> None:
        await self.http.aclose()

    async def access_token(self) -> str | None:
        """The bearer token requests carry (fetched or renewed first when due); None without auth."""
        return await self.credentials.token(self._fetch_token)

    async def _fetch_token(self, body: dict[str, str]) -> Any:
        return await self.json("POST", errors.TOKEN_PATH, body=body, idempotent=True, authorize=False)

    async def send(
        self,
        method: str,
        url: str,
        *,
        body: Any = None,
        content: bytes | None = None,
        params: Mapping[str, Any] | None = None,
        idempotent: bool,
        stream: bool = False,
        timeouts: httpx.Timeout | None = None,
        authorize: bool = True,
    ) -> httpx.Response:
        """Send a request and return a successful response; raise the matching error otherwise.

        `body` is sent as JSON (or `content` as it is, already JSON). With
        `stream`, the caller reads and closes the response.
        """
        if body is not None:
            if jsoncodec.non_finite(body):  # written as null otherwise
                raise errors.InvalidInputError(jsoncodec.FINITE_NUMBERS)
            content = jsoncodec.dumps(body)
        headers = {"Content-Type": "application/json"} if content is not None else {}
        retries = 0
        renewed = False
        while True:
            token = await self.access_token() if authorize else None
            if token is not None:
                headers["Authorization"] = f"Bearer {token}"
            request = self.http.build_request(
                method,
                url,
                content=content,
                params=params,
                headers=headers,
                timeout=timeouts if timeouts is not None else httpx.USE_CLIENT_DEFAULT,
            )
            try:
                response = await self.http.send(request, stream=stream)
            except httpx.TransportError as exc:
                if (idempotent or isinstance(exc, _NOT_SENT)) and retries + 1 < self.retry.attempts:
                    await asyncio.sleep(self.retry.delay(retries))
                    retries += 1
                    continue
                reason = str(exc) or type(exc).__name__
                if isinstance(exc, _NOT_SENT):
                    problem = f"cannot be reached ({reason})"
                else:  # sent, and not answered: it may have been carried out
                    problem = f"did not answer ({reason}): the request may have been carried out"
                raise errors.ServerUnavailableError(
                    f"the server at {self.http.base_url} {problem}", sent=not isinstance(exc, _NOT_SENT)
                ) from exc
            if response.status_code < 300:
                return response
            await response.aread()
            await response.aclose()
            if response.status_code < 400:  # the API never redirects: the URL is not the API's
                where = response.headers.get("Location", "elsewhere")
                raise errors.APIError(
                    f"the server at {self.http.base_url} answered {method} {request.url.path} "
                    f"with {response.status_code}, to {where}: check the server URL",
                    status=response.status_code,
                )
            if (
                response.status_code == 401
                and token is not None
                and not renewed
                and self.credentials.renewable
            ):
                # Expired early or revoked (the client was updated): one new token, then give up.
                self.credentials.forget(token)
                renewed = True
                continue
            if response.status_code == 503 and idempotent and retries + 1 < self.retry.attempts:
                await asyncio.sleep(self.retry.delay(retries))
                retries += 1
                continue
            raise errors.for_status(response.status_code, _detail(response), method, request.url.path)

    async def json(self, method: str, url: str, **options: Any) -> Any:
        """`send` (same arguments), then the JSON answer (None for an empty one)."""
        response = await self.send(method, url, **options)
        return jsoncodec.loads(response.content) if response.content else None


def _detail(response: httpx.Response) -> Any:
    try:
        body = jsoncodec.loads(response.content)
    except ValueError:
        return response.text.strip()[:500] or None
    return body.get("detail") if isinstance(body, dict) else body
