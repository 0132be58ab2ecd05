"""The console's pages and forms.

Every figure and every change goes through the API's own route functions
(fastpubsub.api.routers), called with the signed-in client's principal: a page
shows what the API would answer that client, and a form is allowed exactly
when the API would allow the same request. Forms answer with a redirect to the
page they came from (post/redirect/get), except those that show a new secret
once.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any, ParamSpec
from urllib.parse import quote, urlsplit
from uuid import UUID

import orjson
from fastapi import APIRouter, Query, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from fastapi.templating import Jinja2Templates
from jinja2 import Environment, PackageLoader, select_autoescape
from pydantic import ValidationError

from fastpubsub import auth
from fastpubsub.api import errors
from fastpubsub.api.deps import Principal
from fastpubsub.api.params import SubscriptionId, TopicId
from fastpubsub.api.routers import clients, oauth, subscriptions, topics
from fastpubsub.api.schemas import (
    MAX_PEEK,
    ClientCreate,
    ClientUpdate,
    PublishRequest,
    SeekRequest,
    SubscriptionCreate,
    SubscriptionUpdate,
    TopicCreate,
)
from fastpubsub.console import charts, forms, session
from fastpubsub.console.history import History
from fastpubsub.exceptions import FastPubSubError, InvalidInputError
from fastpubsub.scopes import SCOPES_PATTERN

router = APIRouter(prefix="/console", include_in_schema=False)
templates = Jinja2Templates(
    env=Environment(loader=PackageLoader("fastpubsub.console", "templates"), autoescape=select_autoescape())
)
# JSON shown as the API sends it (Jinja's own tojson writes < as \u003c, which is for scripts, not text).
templates.env.filters["json"] = lambda value: orjson.dumps(value).decode()
templates.env.filters["json_pretty"] = lambda value: orjson.dumps(value, option=orjson.OPT_INDENT_2).decode()
# Pages served to browsers never end up in a cache or a frame, and run only this server's scripts.
_HEADERS = {
    "Cache-Control": "no-store",
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'; "
    "form-action 'self'; base-uri 'none'",
}
# What a redirect after a form says happened (a fixed text per key: nothing from the URL is shown).
NOTICES = {
    "published": "Published.",
    "topic": "Topic created.",
    "subscription": "Subscription created.",
    "updated": "Subscription updated.",
    "seek": "Replay started: retained messages from that time are deliverable again.",
    "reprocessed": "The selected dead letters are deliverable again.",
    "nothing": "Nothing was selected.",
    "disabled": "Client disabled: its tokens no longer work.",
    "enabled": "Client enabled.",
    "signed-out": "Signed out.",
}
PAGE = 50
P = ParamSpec("P")


def history(request: Request) -> History:
    """This process's samples, started by the first console request."""
    state = request.app.state
    if getattr(state, "console_history", None) is None:
        state.console_history = History(state.database, state.settings.console_sample_seconds)
    found: History = state.console_history
    found.start()
    return found


def render(request: Request, template: str, context: dict[str, Any], status: int = 200) -> HTMLResponse:
    principal: Principal | None = context.get("principal")

    def can(scope: str, object_id: str | None = None) -> bool:
        return principal is not None and auth.grants(principal.scopes, scope, object_id)

    notice = NOTICES.get(request.query_params.get("notice", ""))
    response = templates.TemplateResponse(
        request,
        template,
        {
            "auth_enabled": request.app.state.settings.auth_enabled,
            "csrf_token": session.csrf_token(request),
            "csrf_field": session.CSRF_FIELD,
            "can": can,
            "notice": notice,
            "refresh": False,
            **context,
        },
        status_code=status,
        headers=_HEADERS,
    )
    session.remember_csrf(request, response)
    return response


async def signed_form(request: Request) -> tuple[Principal, forms.Form]:
    """Who sends the form (else: sign in), and the form once its CSRF token is checked."""
    return await session.principal(request), await session.form(request)


def back(path: str, notice: str) -> RedirectResponse:
    """Post/redirect/get: to a console page, with what happened."""
    return RedirectResponse(f"{path}?notice={notice}", status_code=303, headers={"Cache-Control": "no-store"})


def page(
    handler: Callable[P, Awaitable[Response]],
) -> Callable[P, Awaitable[Response]]:
    """Errors become pages: sign in again (401), or the API's status and detail in HTML."""

    @functools.wraps(handler)
    async def wrapper(*args: P.args, **kwargs: P.kwargs) -> Response:
        request = kwargs["request"]
        assert isinstance(request, Request)
        try:
            return await handler(*args, **kwargs)
        except session.NotSignedIn as exc:
            if request.method == "GET":
                return RedirectResponse(
                    f"/console/login?next={quote(_place(request.url.path, request.url.query), safe='/')}",
                    status_code=303,
                    headers={"Cache-Control": "no-store"},
                )
            # A form sent once the session had ended: nothing was done; back to its page afterwards.
            context = {"error": f"{exc} (the form was not sent)", "next": _form_page(request)}
            return render(request, "login.html", context, status=401)
        except ValidationError as exc:
            problems = errors.validation_text(exc.errors(), "form")
            return render(request, "error.html", {"status": 422, "detail": problems}, status=422)
        except FastPubSubError as exc:
            status = errors.STATUS.get(type(exc), 0) or next(
                (code for kind, code in errors.STATUS.items() if isinstance(exc, kind)), 500
            )
            return render(request, "error.html", {"status": status, "detail": str(exc)}, status=status)

    return wrapper


# -- signing in ---------------------------------------------------------------
def _next(value: str) -> str:
    """Only a console path is a place to go after signing in (never another site)."""
    return value if value.startswith("/console") and not value.startswith("//") else "/console"


def _place(path: str, query: str) -> str:
    """A page as a path with its query, if any."""
    return path + (f"?{query}" if query else "")


def _form_page(request: Request) -> str:
    """The console page a form was sent from (its Referer, when it is one of ours), else the overview."""
    referer = urlsplit(request.headers.get("referer", ""))
    if referer.netloc != request.url.netloc:
        return "/console"
    return _next(_place(referer.path, referer.query))


@router.get("/login")
@page
async def login_page(request: Request, next: str = "/console") -> Response:
    if not request.app.state.settings.auth_enabled:
        return RedirectResponse("/console", status_code=303)
    return render(request, "login.html", {"next": _next(next)})


@router.post("/login")
@page
async def login(request: Request) -> Response:
    form = await session.form(request)
    target = _next(forms.text(form, "next"))
    if not request.app.state.settings.auth_enabled:
        return RedirectResponse(target, status_code=303)
    try:
        token = await oauth.exchange_credentials(
            request, forms.text(form, "client_id"), forms.text(form, "client_secret"), None, basic=False
        )
    except oauth.OAuthError as exc:
        context = {"error": exc.description, "next": target, "client_id": forms.text(form, "client_id")}
        refused = render(request, "login.html", context, status=exc.status)
        if exc.retry_after:  # too many failed attempts: when to try again, as POST /oauth/token says
            refused.headers["Retry-After"] = str(exc.retry_after)
        return refused
    response = RedirectResponse(target, status_code=303, headers={"Cache-Control": "no-store"})
    session.sign_in(request, response, token.access_token, token.expires_in)
    return response


@router.post("/logout")
@page
async def logout(request: Request) -> Response:
    await session.form(request)
    response = back("/console/login", "signed-out")
    session.sign_out(response)
    return response


# -- overview -----------------------------------------------------------------
def _rates(samples: History, subscription_id: str) -> tuple[charts.Line, float]:
    points = samples.points(subscription_id)
    return charts.line([p.backlog for p in points]), points[-1].acks_per_minute if points else 0.0


@router.get("")
@page
async def overview(request: Request, offset: int = Query(0, ge=0, le=10_000_000)) -> Response:
    principal = await session.principal(request)
    database, samples = request.app.state.database, history(request)
    rows: list[dict[str, Any]] = []
    listed = auth.grants(principal.scopes, "topics:read")
    topic_list = await topics.list_topics(database, principal, offset, PAGE) if listed else None
    for topic in topic_list.data if topic_list else []:
        stats = await topics.topic_stats(topic.id, database, principal)
        rows.append(
            {
                "topic": topic,
                "stats": stats,
                "subscriptions": [(s, *_rates(samples, s.subscription_id)) for s in stats.subscriptions],
            }
        )
    context = {
        "principal": principal,
        "rows": rows,
        "listed": listed,
        "offset": offset,
        "page_size": PAGE,
        "refresh": True,
    }
    return render(request, "overview.html", context)


@router.post("/topics")
@page
async def create_topic(request: Request) -> Response:
    principal, form = await signed_form(request)
    body = TopicCreate.model_validate(
        forms.fields(form, {"id": forms.text, "retention_seconds": forms.integer})
    )
    topic = await topics.create_topic(body, request.app.state.database, principal)
    return back(f"/console/topics/{topic.id}", "topic")


# -- a topic ------------------------------------------------------------------
@router.get("/topics/{topic_id}")
@page
async def topic_page(request: Request, topic_id: TopicId) -> Response:
    principal = await session.principal(request)
    database, samples = request.app.state.database, history(request)
    stats = await topics.topic_stats(topic_id, database, principal)
    context = {
        "principal": principal,
        "topic_id": topic_id,
        "stats": stats,
        "subscriptions": [(s, *_rates(samples, s.subscription_id)) for s in stats.subscriptions],
        "refresh": True,
    }
    return render(request, "topic.html", context)


@router.post("/topics/{topic_id}/publish")
@page
async def publish(request: Request, topic_id: TopicId) -> Response:
    principal, form = await signed_form(request)
    principal.require("topics:publish", topic_id)
    payload = forms.json_object(form, "payload")
    if payload is None:
        raise InvalidInputError('payload: write a JSON object, e.g. {"hello": "world"}')
    message = {"payload": payload, **forms.fields(form, {"attributes": forms.json_object})}
    body = PublishRequest.model_validate({"messages": [message]})  # the API's rules, before sending
    await request.app.state.delivery.publish_envelopes(
        topic_id, body.model_dump_json(exclude_unset=True).encode()
    )
    return back(f"/console/topics/{topic_id}", "published")


@router.post("/subscriptions")
@page
async def create_subscription(request: Request) -> Response:
    principal, form = await signed_form(request)
    body = SubscriptionCreate.model_validate(
        forms.fields(
            form,
            {"id": forms.text, "topic_id": forms.text, "filter": forms.json_object, "start": forms.text},
        )
    )
    state = request.app.state
    created = await subscriptions.create_subscription(
        body, state.database, principal, state.settings, state.backfills
    )
    return back(f"/console/subscriptions/{created.id}", "subscription")


# -- a subscription -----------------------------------------------------------
@router.get("/subscriptions/{subscription_id}")
@page
async def subscription_page(request: Request, subscription_id: SubscriptionId) -> Response:
    principal = await session.principal(request)
    database = request.app.state.database
    subscription = await subscriptions.get_subscription(subscription_id, database, principal)
    metrics = await subscriptions.subscription_metrics(subscription_id, database, principal)
    points = history(request).points(subscription_id)
    peeked = None
    if auth.grants(principal.scopes, "subscriptions:peek", subscription_id):
        peeked = (await subscriptions.peek_messages(subscription_id, database, principal, 20)).data
    lines = {
        name: charts.line([getattr(p, name) for p in points])
        for name in ("backlog", "in_flight", "dlq", "oldest_age", "acks_per_minute")
    }
    context = {
        "principal": principal,
        "subscription": subscription,
        "metrics": metrics,
        "lines": lines,
        "since": datetime.fromtimestamp(points[0].at, UTC) if points else None,
        "peeked": peeked,
        "max_peek": MAX_PEEK,
        "now": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M"),
        "refresh": True,
    }
    return render(request, "subscription.html", context)


_POLICY_FIELDS: dict[str, Any] = {
    "max_delivery_attempts": forms.integer,
    "backoff_min_seconds": forms.integer,
    "backoff_max_seconds": forms.integer,
    "ack_deadline_seconds": forms.integer,
    "retry_policy": forms.text,
    "retry_jitter": forms.number,
    "expiry_policy": forms.text,
    "backlog_policy": forms.text,
}


@router.post("/subscriptions/{subscription_id}")
@page
async def update_subscription(request: Request, subscription_id: SubscriptionId) -> Response:
    principal, form = await signed_form(request)
    # The fields a blank removes (the filter, the TTL and the backlog limit) are always sent.
    changes = {
        **forms.fields(form, _POLICY_FIELDS),
        "filter": forms.json_object(form, "filter"),
        "message_ttl_seconds": forms.integer(form, "message_ttl_seconds"),
        "max_backlog": forms.integer(form, "max_backlog"),
    }
    body = SubscriptionUpdate.model_validate(changes)
    state = request.app.state
    await subscriptions.update_subscription(subscription_id, body, state.database, principal, state.settings)
    return back(f"/console/subscriptions/{subscription_id}", "updated")


@router.post("/subscriptions/{subscription_id}/seek")
@page
async def seek(request: Request, subscription_id: SubscriptionId) -> Response:
    principal, form = await signed_form(request)
    when = forms.text(form, "time")
    if len(when) == 16:  # a datetime-local field: minutes, in UTC as the page says
        when += ":00Z"
    body = SeekRequest.model_validate({"time": when})
    await subscriptions.seek_subscription(subscription_id, body, request.app.state.delivery, principal)
    return back(f"/console/subscriptions/{subscription_id}", "seek")


# -- dead letters -------------------------------------------------------------
def _reason(attempts: int, subscription: Any) -> str:
    """Why a message is in the DLQ, as far as its attempts and the policy tell (no reason is stored)."""
    if attempts >= subscription.max_delivery_attempts:
        times = "once" if attempts == 1 else f"{attempts} times"
        return f"delivery failed {times} (the limit is {subscription.max_delivery_attempts})"
    if subscription.expiry_policy == "dead_letter":
        return "expired (message TTL) before it was delivered successfully"
    return "unknown"


@router.get("/subscriptions/{subscription_id}/dlq")
@page
async def dlq_page(
    request: Request, subscription_id: SubscriptionId, offset: int = Query(0, ge=0, le=10_000_000)
) -> Response:
    principal = await session.principal(request)
    database = request.app.state.database
    subscription = await subscriptions.get_subscription(subscription_id, database, principal)
    answer = await subscriptions.list_dlq(subscription_id, database, principal, offset, PAGE)
    letters = orjson.loads(answer.body)["data"]
    for letter in letters:
        letter["reason"] = _reason(letter["delivery_attempts"], subscription)
        letter["published"] = datetime.fromisoformat(letter["created_at"])
    context = {
        "principal": principal,
        "subscription": subscription,
        "letters": letters,
        "offset": offset,
        "page_size": PAGE,
    }
    return render(request, "dlq.html", context)


@router.post("/subscriptions/{subscription_id}/dlq/reprocess")
@page
async def reprocess(request: Request, subscription_id: SubscriptionId) -> Response:
    principal, form = await signed_form(request)
    try:
        ids = [UUID(value) for value in form.get("id", [])]
    except ValueError as exc:
        raise InvalidInputError("id: each selected message must be a message id (a UUID)") from exc
    if not ids:
        return back(f"/console/subscriptions/{subscription_id}/dlq", "nothing")
    await subscriptions.reprocess_dlq(subscription_id, ids, request.app.state.delivery, principal)
    return back(f"/console/subscriptions/{subscription_id}/dlq", "reprocessed")


# -- clients ------------------------------------------------------------------
@router.get("/clients")
@page
async def clients_page(request: Request, offset: int = Query(0, ge=0, le=10_000_000)) -> Response:
    principal = await session.principal(request)
    listing = await clients.list_clients(request.app.state.database, principal, offset, PAGE)
    context = {
        "principal": principal,
        "clients": listing.data,
        "offset": offset,
        "page_size": PAGE,
        "scopes_pattern": SCOPES_PATTERN,
    }
    return render(request, "clients.html", context)


def _secret_page(
    request: Request, principal: Principal, client_id: UUID, secret: str, made: bool
) -> Response:
    context = {"principal": principal, "client_id": client_id, "secret": secret, "made": made}
    return render(request, "secret.html", context)


@router.post("/clients")
@page
async def create_client(request: Request) -> Response:
    principal, form = await signed_form(request)
    body = ClientCreate.model_validate(forms.fields(form, {"name": forms.text, "scopes": forms.text}))
    state = request.app.state
    created = await clients.create_client(body, state.database, principal, state.settings)
    return _secret_page(request, principal, created.id, created.secret, made=True)


@router.post("/clients/{client_id}/secret")
@page
async def rotate_secret(request: Request, client_id: UUID) -> Response:
    principal, _ = await signed_form(request)
    state = request.app.state
    rotated = await clients.rotate_client_secret(
        client_id, request, state.database, principal, state.settings
    )
    return _secret_page(request, principal, rotated.id, rotated.secret, made=False)


@router.post("/clients/{client_id}/active")
@page
async def set_active(request: Request, client_id: UUID) -> Response:
    principal, form = await signed_form(request)
    active = forms.text(form, "active") == "true"
    state = request.app.state
    # Its name and scopes stay as they are: read here, not through GET /clients/{id}, which would
    # ask for clients:read on top of the clients:update that PUT asks for.
    principal.require("clients:update", str(client_id))  # before saying whether it exists
    current = await state.database.get_client(client_id)
    body = ClientUpdate(name=current.name, scopes=current.scopes, is_active=active)
    await clients.update_client(client_id, body, request, state.database, principal, state.settings)
    return back("/console/clients", "enabled" if active else "disabled")
