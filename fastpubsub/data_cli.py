"""The data-plane commands: topics, subscriptions, publish, pull, dlq and tail, over HTTP.

They talk to a server through the SDK (fastpubsub.client): `--url`, else
FASTPUBSUB_API_URL, else the `fastpubsub dev` running from this directory
(said in one line on stderr). With auth on, FASTPUBSUB_API_TOKEN or
FASTPUBSUB_API_CLIENT_ID and FASTPUBSUB_API_CLIENT_SECRET give the
credentials. Output is a table for people and JSON with `--json`; errors are
one line on stderr with the CLI's exit codes. The SDK (httpx, pydantic) is
imported by each command, so that `fastpubsub --help` stays quick.
"""

from __future__ import annotations

import logging
import re
import sys
from collections.abc import Awaitable, Callable, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import typer

from fastpubsub import cli
from fastpubsub.exceptions import ConfigurationError, InvalidInputError, ServerUnavailableError

if TYPE_CHECKING:
    from pydantic import BaseModel

    from fastpubsub.client import AsyncClient, MessageOut
    from fastpubsub.client.aio import SubscriptionPolicies

T = TypeVar("T")

Url = Annotated[
    str | None,
    typer.Option(
        "--url", help="Server [FASTPUBSUB_API_URL; else the running fastpubsub dev]", show_default=False
    ),
]
Json = Annotated[bool, typer.Option("--json", help="JSON for scripts instead of a table")]
Offset = Annotated[int, typer.Option(min=0, max=10_000_000, help="Skip this many")]
Limit = Annotated[int, typer.Option(min=1, max=1000, help="At most this many")]
SubscriptionArg = Annotated[str, typer.Argument(help="Subscription id")]
TopicArg = Annotated[str, typer.Argument(help="Topic id")]
FilterOption = Annotated[
    str | None, typer.Option("--filter", help='JSON object, e.g. \'{"country": ["BR"]}\' (docs/filters.md)')
]
Attempts = Annotated[int | None, typer.Option(min=1, max=1000, help="Deliveries before the DLQ")]
BackoffMin = Annotated[int | None, typer.Option(min=0, max=86400, help="First retry delay, seconds")]
BackoffMax = Annotated[int | None, typer.Option(min=0, max=86400, help="Longest retry delay, seconds")]
AckDeadline = Annotated[int | None, typer.Option(min=1, max=3600, help="Lease length, seconds")]
RetryPolicyOption = Annotated[
    str | None,
    typer.Option(
        "--retry-policy", help="fixed, linear or exponential: the wait before a retry, from --backoff-min"
    ),
]
Jitter = Annotated[
    float | None, typer.Option("--retry-jitter", min=0, max=1, help="Take up to this fraction off each wait")
]
Ttl = Annotated[
    int | None,
    typer.Option(
        "--ttl", min=1, max=315360000, help="Messages older than this (seconds) are never delivered"
    ),
]
ExpiryPolicyOption = Annotated[
    str | None, typer.Option("--expiry-policy", help="drop or dead_letter: what becomes of expired messages")
]
MaxBacklog = Annotated[
    int | None,
    typer.Option(
        "--max-backlog", min=1, max=1000000000, help="Messages waiting, in flight or delayed at most"
    ),
]
BacklogPolicyOption = Annotated[
    str | None,
    typer.Option(
        "--backlog-policy", help="reject (a 429 for the publish) or drop_oldest, past --max-backlog"
    ),
]
PushEndpoint = Annotated[
    str | None,
    typer.Option(
        "--push-endpoint",
        help="Make it a push subscription: fastpubsub push-worker POSTs its messages here (https://)",
    ),
]
PushHeaders = Annotated[
    list[str] | None,
    typer.Option(
        "--push-header",
        help="'Name: value' sent with every push request (the receiver's credentials, say); repeat for more",
    ),
]
PushTimeout = Annotated[
    int | None, typer.Option("--push-timeout", min=1, max=60, help="Seconds a push request may take")
]
PushConcurrency = Annotated[
    int | None,
    typer.Option("--push-max-concurrency", min=1, max=100, help="Push requests in flight per push-worker"),
]
Retention = Annotated[
    int | None,
    typer.Option(
        "--retention-seconds", min=60, max=315360000, help="Cleanup deletes its messages once this old"
    ),
]

topics_app = typer.Typer(
    help="Create, list, show, update and delete topics, and their stats.", no_args_is_help=True
)
subscriptions_app = typer.Typer(
    help="Create, list, show, change, replay and delete subscriptions; their metrics.", no_args_is_help=True
)
dlq_app = typer.Typer(help="Dead letters of a subscription: list and reprocess.", no_args_is_help=True)


# -- plumbing --------------------------------------------------------------------------------------


def _client(url: str | None) -> AsyncClient:
    """A client for --url, FASTPUBSUB_API_URL or the dev server running here, with the env's credentials."""
    from fastpubsub import dev
    from fastpubsub.client import AsyncClient, Retry

    settings = cli._settings()
    target = url if url is not None else settings.api_url  # --url "" is a URL to refuse, not none
    if target is None:
        running = dev.find(settings.embedded_data_dir)
        if running is None:
            raise cli.fail(
                "no server to talk to: pass --url or set FASTPUBSUB_API_URL, or start one here with "
                "`make run` (fastpubsub dev) in another terminal",
                cli.EXIT_CODES[ConfigurationError],
            )
        typer.echo(f"using the dev server at {running.api_url}", err=True)
        target = running.api_url
        _check_server_url(target, "the dev server's URL (in its dev.json)")
    else:
        _check_server_url(target, "--url" if url is not None else "FASTPUBSUB_API_URL")
    try:
        return AsyncClient(
            target,
            token=settings.api_token,
            client_id=settings.api_client_id,
            client_secret=settings.api_client_secret,
            # A person is waiting: say soon that the server cannot be reached.
            retry=Retry(attempts=3, backoff_min=0.2, backoff_max=1.0),
        )
    except ValueError as exc:  # both a token and client credentials, or half of the credentials
        raise cli.fail(
            f"FASTPUBSUB_API_TOKEN, FASTPUBSUB_API_CLIENT_ID, FASTPUBSUB_API_CLIENT_SECRET: {exc}",
            cli.EXIT_CODES[ConfigurationError],
        ) from None


def _check_server_url(target: str, given_by: str) -> None:
    """An http(s) URL with a host, or one line saying what is wrong with it (before any connection)."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(target)
        parts.port  # noqa: B018 - a port that is not a number raises here
    except ValueError:  # (its own words may quote part of a password)
        problem: str | None = "its port must be a number from 1 to 65535"
    else:
        if parts.scheme not in ("http", "https"):
            problem = "it must start with http:// or https://"
        elif not parts.hostname:
            problem = "it names no host"
        elif parts.port == 0:
            problem = "port 0 cannot be connected to"
        elif parts.query or parts.fragment:
            problem = "it must not carry a query or a fragment"
        else:
            problem = None
    if problem is not None:
        from fastpubsub.db.urls import mask_url

        code = cli.EXIT_CODES[InvalidInputError if given_by == "--url" else ConfigurationError]
        raise cli.fail(f'{given_by} "{mask_url(target)}" is not a server URL: {problem}', code)


def _call(url: str | None, work: Callable[[AsyncClient], Awaitable[T]]) -> T:
    """Run `work` with a client; errors become one line and an exit code."""
    client = _client(url)

    async def run() -> T:
        async with client:
            return await work(client)

    return cli.run(run)


def _invalid(message: str) -> typer.Exit:
    return cli.fail(message, cli.EXIT_CODES[InvalidInputError])


def _payload(text: str, what: str) -> dict[str, Any]:
    """A JSON object given on the command line or stdin (a message, a filter)."""
    from fastpubsub import jsoncodec

    try:
        value = jsoncodec.loads(text)
    except ValueError as exc:
        raise InvalidInputError(f"{what} is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise InvalidInputError(f"{what} must be a JSON object, not {_json_kind(value)}")
    return value


def _problem(exc: Exception) -> str:
    """An error as one line; a model's validation errors as `field: what is wrong`, joined."""
    from pydantic import ValidationError

    from fastpubsub.client.errors import detail_text

    if isinstance(exc, ValidationError):  # the shape of the server's 422 detail
        return detail_text(exc.errors(include_url=False))
    return " ".join(str(exc).split())


def _json_kind(value: Any) -> str:
    """What a decoded JSON value is, in JSON's words ("an array", "null", ...)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    return "an array" if isinstance(value, list) else type(value).__name__


def _filter(text: str | None) -> dict[str, Any] | None:
    """--filter: a JSON object, or `null` for none."""
    if text is None or text.strip() == "null":
        return None
    try:
        return _payload(text, "--filter")
    except InvalidInputError as exc:
        raise _invalid(exc.message) from None


def _dump(value: Any) -> str:
    from fastpubsub import jsoncodec

    return jsoncodec.dumps_text(value)


def _jsonable(value: BaseModel | Sequence[BaseModel]) -> Any:
    if isinstance(value, Sequence):
        return [item.model_dump(mode="json") for item in value]
    return value.model_dump(mode="json")


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, dict | list):
        return _dump(value)
    if isinstance(value, datetime):
        return value.isoformat(timespec="seconds")
    return str(value)


def _table(rows: Sequence[Sequence[Any]], header: Sequence[str], empty: str) -> None:
    """Columns padded to their widest cell, the last one as it is."""
    if not rows:
        typer.echo(empty)
        return
    cells = [list(header), *([_cell(value) for value in row] for row in rows)]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header) - 1)]
    for row in cells:
        typer.echo("  ".join([*(value.ljust(widths[i]) for i, value in enumerate(row[:-1])), row[-1]]))


def _fields(model: BaseModel, as_json: bool, exclude: dict[str, Any] | None = None) -> None:
    """One object: JSON, or `name: value` lines (without what `exclude` names, as model_dump takes it)."""
    if as_json:
        typer.echo(_dump(_jsonable(model)))
        return
    for name, value in model.model_dump(exclude=exclude).items():
        typer.echo(f"{name}: {_cell(value)}")


def _messages(messages: Sequence[MessageOut], as_json: bool, empty: str) -> None:
    if as_json:
        typer.echo(_dump(_jsonable(messages)))
        return
    rows = [(m.id, m.delivery_attempts, m.priority, m.attributes, m.payload) for m in messages]
    _table(rows, ("ID", "ATTEMPTS", "PRIORITY", "ATTRIBUTES", "PAYLOAD"), empty)


# -- topics ----------------------------------------------------------------------------------------


@topics_app.command("create")
def topics_create(
    topic_id: TopicArg, retention_seconds: Retention = None, url: Url = None, as_json: Json = False
) -> None:
    """Create a topic."""
    topic = _call(url, lambda client: client.create_topic(topic_id, retention_seconds=retention_seconds))
    if as_json:
        _fields(topic, as_json)
    else:
        typer.echo(f"created topic {topic.id}")


@topics_app.command("list")
def topics_list(url: Url = None, as_json: Json = False, offset: Offset = 0, limit: Limit = 100) -> None:
    """List topics."""
    topics = _call(url, lambda client: client.list_topics(offset, limit))
    if as_json:
        typer.echo(_dump(_jsonable(topics)))
    else:
        _table([(t.id, t.created_at) for t in topics], ("ID", "CREATED"), "(no topics)")


@topics_app.command("get")
def topics_get(topic_id: TopicArg, url: Url = None, as_json: Json = False) -> None:
    """Show a topic."""
    _fields(_call(url, lambda client: client.get_topic(topic_id)), as_json)


@topics_app.command("update")
def topics_update(
    topic_id: TopicArg,
    retention_seconds: Retention = None,
    no_retention: Annotated[bool, typer.Option("--no-retention", help="Remove the retention")] = False,
    url: Url = None,
    as_json: Json = False,
) -> None:
    """Change a topic's retention."""
    if no_retention and retention_seconds is not None:
        raise _invalid("give --retention-seconds or --no-retention, not both")
    if no_retention:
        topic = _call(url, lambda client: client.update_topic(topic_id, retention_seconds=None))
    elif retention_seconds is not None:
        topic = _call(url, lambda client: client.update_topic(topic_id, retention_seconds=retention_seconds))
    else:
        topic = _call(url, lambda client: client.get_topic(topic_id))
    _fields(topic, as_json)


@topics_app.command("stats")
def topics_stats(topic_id: TopicArg, url: Url = None, as_json: Json = False) -> None:
    """A topic's subscriptions with their backlogs, its retained messages and recent publishing."""
    stats = _call(url, lambda client: client.topic_stats(topic_id))
    if as_json:
        _fields(stats, as_json)
        return
    typer.echo(
        f"topic {stats.topic_id}: {_count(stats.messages_retained, 'message')} retained, "
        f"{stats.published_last_minute} published in the last minute, {stats.published_last_hour} in the "
        f"last hour, oldest {stats.oldest_message_age_seconds:.0f} s"
    )
    rows = [
        (
            s.subscription_id,
            s.backlog,
            s.max_backlog,
            s.in_flight,
            s.delayed,
            s.dlq,
            s.expired,
            s.dropped,
            f"{s.oldest_available_age_seconds:.0f} s",
        )
        for s in stats.subscriptions
    ]
    header = ("SUBSCRIPTION", "BACKLOG", "MAX", "IN FLIGHT", "DELAYED", "DLQ", "EXPIRED", "DROPPED", "OLDEST")
    _table(rows, header, "(no subscriptions)")


@topics_app.command("delete")
def topics_delete(topic_id: TopicArg, url: Url = None) -> None:
    """Delete a topic with its subscriptions and messages."""
    _call(url, lambda client: client.delete_topic(topic_id))
    typer.echo(f"deleted topic {topic_id}")


# -- subscriptions ---------------------------------------------------------------------------------


def _choice(value: str | None, option: str, choices: tuple[str, ...]) -> Any:
    if value is not None and value not in choices:
        raise _invalid(f'{option} must be one of {", ".join(choices)}, not "{value}"')
    return value


# The delivery-policy parameters of `subscriptions create` and `update`, and their names in the API.
_POLICY_NAMES = {
    "max_delivery_attempts": "max_delivery_attempts",
    "backoff_min": "backoff_min_seconds",
    "backoff_max": "backoff_max_seconds",
    "ack_deadline": "ack_deadline_seconds",
    "retry_policy": "retry_policy",
    "retry_jitter": "retry_jitter",
    "ttl": "message_ttl_seconds",
    "expiry_policy": "expiry_policy",
    "max_backlog": "max_backlog",
    "backlog_policy": "backlog_policy",
}


def _push(parameters: dict[str, Any]) -> dict[str, Any] | None:
    """The push configuration the --push-* options give (None: none given)."""
    endpoint, headers = parameters["push_endpoint"], parameters["push_header"] or []
    others = {
        "timeout_seconds": parameters["push_timeout"],
        "max_concurrency": parameters["push_max_concurrency"],
    }
    if endpoint is None:
        if headers or any(value is not None for value in others.values()):
            raise _invalid("--push-header, --push-timeout and --push-max-concurrency need --push-endpoint")
        return None
    push: dict[str, Any] = {"endpoint": endpoint, "headers": {}}
    for header in headers:
        name, colon, value = header.partition(":")
        if not colon or not name.strip():
            raise _invalid(f'--push-header must be "Name: value", not "{header}"')
        push["headers"][name.strip()] = value.strip()
    push.update({key: value for key, value in others.items() if value is not None})
    return push


def _said_push(subscription: Any) -> None:
    """The signing secret, when the answer carries it (it is shown once)."""
    push = subscription.push
    if push is not None and push.secret is not None:
        typer.echo(f"pushing to {push.endpoint}, signed with {push.secret} (shown once: keep it)")


def _policy(parameters: dict[str, Any]) -> SubscriptionPolicies:
    """The delivery-policy options a command was given (its parameters, by name), by the API's names;
    those left out are not sent."""
    _choice(parameters["retry_policy"], "--retry-policy", ("fixed", "linear", "exponential"))
    _choice(parameters["expiry_policy"], "--expiry-policy", ("drop", "dead_letter"))
    _choice(parameters["backlog_policy"], "--backlog-policy", ("reject", "drop_oldest"))
    given: Any = {
        api: parameters[name] for name, api in _POLICY_NAMES.items() if parameters[name] is not None
    }
    return given  # type: ignore[no-any-return]  # names and types as SubscriptionPolicies has them


@subscriptions_app.command("create")
def subscriptions_create(
    subscription_id: SubscriptionArg,
    topic: Annotated[str, typer.Option("--topic", help="The topic it receives from")],
    filter_json: FilterOption = None,
    max_delivery_attempts: Attempts = None,
    backoff_min: BackoffMin = None,
    backoff_max: BackoffMax = None,
    ack_deadline: AckDeadline = None,
    retry_policy: RetryPolicyOption = None,
    retry_jitter: Jitter = None,
    ttl: Ttl = None,
    expiry_policy: ExpiryPolicyOption = None,
    max_backlog: MaxBacklog = None,
    backlog_policy: BacklogPolicyOption = None,
    push_endpoint: PushEndpoint = None,
    push_header: PushHeaders = None,
    push_timeout: PushTimeout = None,
    push_max_concurrency: PushConcurrency = None,
    start: Annotated[
        str,
        typer.Option(help="latest, earliest (every retained message too) or an ISO 8601 time with a zone"),
    ] = "latest",
    url: Url = None,
    as_json: Json = False,
) -> None:
    """Create a subscription (policies left out take the server's defaults)."""
    subscription_filter = _filter(filter_json)
    policy = _policy(locals())
    push = _push(locals())
    if push is not None:
        policy["push"] = push  # type: ignore[typeddict-item]  # the API checks it
    begin: Any = start if start in ("latest", "earliest") else _time(start)
    subscription = _call(
        url,
        lambda client: client.create_subscription(
            subscription_id, topic, filter=subscription_filter, start=begin, **policy
        ),
    )
    if as_json:
        _fields(subscription, as_json)
    else:
        filling = " (adding its retained messages)" if subscription.backfilling else ""
        typer.echo(f"created subscription {subscription.id} on topic {subscription.topic_id}{filling}")
        _said_push(subscription)


@subscriptions_app.command("list")
def subscriptions_list(
    url: Url = None, as_json: Json = False, offset: Offset = 0, limit: Limit = 100
) -> None:
    """List subscriptions."""
    subscriptions = _call(url, lambda client: client.list_subscriptions(offset, limit))
    if as_json:
        typer.echo(_dump(_jsonable(subscriptions)))
        return
    rows = [
        (s.id, s.topic_id, s.max_delivery_attempts, s.ack_deadline_seconds, s.filter) for s in subscriptions
    ]
    _table(rows, ("ID", "TOPIC", "ATTEMPTS", "ACK DEADLINE", "FILTER"), "(no subscriptions)")


@subscriptions_app.command("get")
def subscriptions_get(subscription_id: SubscriptionArg, url: Url = None, as_json: Json = False) -> None:
    """Show a subscription: filter and delivery policy."""
    _fields(_call(url, lambda client: client.get_subscription(subscription_id)), as_json)


@subscriptions_app.command("update")
def subscriptions_update(
    subscription_id: SubscriptionArg,
    filter_json: Annotated[
        str | None, typer.Option("--filter", help="New filter, a JSON object; 'null' removes it")
    ] = None,
    max_delivery_attempts: Attempts = None,
    backoff_min: BackoffMin = None,
    backoff_max: BackoffMax = None,
    ack_deadline: AckDeadline = None,
    retry_policy: RetryPolicyOption = None,
    retry_jitter: Jitter = None,
    ttl: Ttl = None,
    no_ttl: Annotated[bool, typer.Option("--no-ttl", help="Remove the message TTL")] = False,
    expiry_policy: ExpiryPolicyOption = None,
    max_backlog: MaxBacklog = None,
    no_max_backlog: Annotated[
        bool, typer.Option("--no-max-backlog", help="Remove the backlog limit")
    ] = False,
    backlog_policy: BacklogPolicyOption = None,
    push_endpoint: PushEndpoint = None,
    push_header: PushHeaders = None,
    push_timeout: PushTimeout = None,
    push_max_concurrency: PushConcurrency = None,
    pull: Annotated[
        bool, typer.Option("--pull", help="Make it a pull subscription again (its push secret is forgotten)")
    ] = False,
    url: Url = None,
    as_json: Json = False,
) -> None:
    """Change what is given; the rest stays. --push-* options replace the whole push configuration."""
    from fastpubsub.client import UNSET

    if (no_ttl and ttl is not None) or (no_max_backlog and max_backlog is not None):
        raise _invalid("give a value or remove it (--no-ttl, --no-max-backlog), not both")
    subscription_filter = UNSET if filter_json is None else _filter(filter_json)
    policy = _policy(locals())
    if no_ttl:
        policy["message_ttl_seconds"] = None
    if no_max_backlog:
        policy["max_backlog"] = None
    push = _push(locals())
    if pull and push is not None:
        raise _invalid("give --push-endpoint or --pull, not both")
    if pull or push is not None:
        policy["push"] = push  # type: ignore[typeddict-item]  # the API checks it
    subscription = _call(
        url, lambda client: client.update_subscription(subscription_id, filter=subscription_filter, **policy)
    )
    if as_json:
        _fields(subscription, as_json)
        return
    # A new signing secret is said once, in its own line, not in the push field's too.
    _fields(subscription, as_json, exclude={"push": {"secret"}})
    _said_push(subscription)


@subscriptions_app.command("rotate-push-secret")
def subscriptions_rotate_push_secret(
    subscription_id: SubscriptionArg,
    grace_seconds: Annotated[
        int,
        typer.Option(
            min=0, max=604800, help="How long the current secret keeps signing too (0: it stops now)"
        ),
    ] = 86400,
    url: Url = None,
    as_json: Json = False,
) -> None:
    """A new signing secret for a push subscription, shown once; the current one signs beside it a while."""
    subscription = _call(url, lambda client: client.rotate_push_secret(subscription_id, grace_seconds))
    if as_json:
        _fields(subscription, as_json)
        return
    _said_push(subscription)
    until = subscription.push.previous_secret_valid_until if subscription.push is not None else None
    typer.echo(
        f"the previous secret signs too until {_cell(until)}"
        if until
        else "the previous secret no longer signs"
    )


@subscriptions_app.command("delete")
def subscriptions_delete(subscription_id: SubscriptionArg, url: Url = None) -> None:
    """Delete a subscription and its pending messages."""
    _call(url, lambda client: client.delete_subscription(subscription_id))
    typer.echo(f"deleted subscription {subscription_id}")


@subscriptions_app.command("metrics")
def subscriptions_metrics(subscription_id: SubscriptionArg, url: Url = None, as_json: Json = False) -> None:
    """Counts (available, delivered, delayed, acked, dlq) and the oldest waiting message's age."""
    _fields(_call(url, lambda client: client.metrics(subscription_id)), as_json)


@subscriptions_app.command("peek")
def subscriptions_peek(
    subscription_id: SubscriptionArg,
    limit: Annotated[int, typer.Option(min=1, max=100, help="At most this many")] = 10,
    url: Url = None,
    as_json: Json = False,
) -> None:
    """The next messages in delivery order, with attempts and state; nothing is leased."""
    messages = _call(url, lambda client: client.peek(subscription_id, limit))
    if as_json:
        typer.echo(_dump(_jsonable(messages)))
        return
    rows = [(m.id, m.state, m.delivery_attempts, m.priority, m.attributes, m.payload) for m in messages]
    _table(rows, ("ID", "STATE", "ATTEMPTS", "PRIORITY", "ATTRIBUTES", "PAYLOAD"), "(nothing waiting)")


def _time(text: str) -> datetime:
    """An ISO 8601 time with a zone from the command line."""
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise _invalid(f'"{text}" is not an ISO 8601 time') from None
    if when.tzinfo is None:
        raise _invalid(f'"{text}" has no time zone (add Z or +00:00)')
    return when


@subscriptions_app.command("seek")
def subscriptions_seek(
    subscription_id: SubscriptionArg,
    time: Annotated[str, typer.Argument(help="ISO 8601 time with a zone, e.g. 2026-11-22T10:00:00Z")],
    url: Url = None,
    as_json: Json = False,
) -> None:
    """Replay: deliver again the retained messages published from TIME on."""
    when = _time(time)
    result = _call(url, lambda client: client.seek(subscription_id, when))
    if as_json:
        _fields(result, as_json)
    else:
        typer.echo(f"replaying {result.replayed} messages; {result.acked} earlier ones now count as acked")


# -- publish, pull, tail ---------------------------------------------------------------------------


def publish(
    topic_id: TopicArg,
    message: Annotated[
        str, typer.Argument(help="A JSON object; '-' (the default) reads one per line from stdin")
    ] = "-",
    attribute: Annotated[
        list[str] | None, typer.Option("--attribute", "-a", help="name=value (repeat for more)")
    ] = None,
    priority: Annotated[int, typer.Option(min=0, max=9, help="0-9, higher first")] = 0,
    delay: Annotated[
        float | None, typer.Option(min=0, max=31_536_000, help="Deliver no sooner than this many seconds")
    ] = None,
    idempotency_key: Annotated[
        str | None, typer.Option(help="A repeat returns the original id (one message only)")
    ] = None,
    ttl: Annotated[
        float | None, typer.Option(min=0.001, help="Never delivered once this many seconds old")
    ] = None,
    url: Url = None,
    as_json: Json = False,
) -> None:
    """Publish a message, or one per stdin line (batched); prints the ids in order."""
    import asyncio
    from collections import deque

    from fastpubsub.client import AsyncPublisher, PublishOptions

    attributes = {}
    for item in attribute or []:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise _invalid(f'--attribute takes name=value, not "{item}"')
        if name in attributes:
            raise _invalid(f'--attribute "{name}" is given twice')
        attributes[name] = value
    if message == "-" and idempotency_key is not None:
        raise _invalid("--idempotency-key goes with a single message, not stdin")
    if message == "-" and sys.stdin is None:
        raise _invalid("no message: give one, or lines on stdin (which is closed)")
    options: PublishOptions = {
        "priority": priority,
        "attributes": attributes or None,
        "delay_seconds": delay,
        "idempotency_key": idempotency_key,
        "ttl_seconds": ttl,
    }
    ids: list[str] = []
    # Messages the server refused: each with its line, and the error (shared by a batch's messages).
    refused: list[tuple[int, BaseException]] = []
    stopped: list[str] = []  # why reading stopped early: a line that is not a JSON object, say
    last_read = 0  # the last line read
    stopped_early = False  # reading stopped before the end of stdin

    async def lines() -> Any:
        if message != "-":
            yield 0, "the message", message
            return
        loop = asyncio.get_running_loop()
        # Bytes, decoded a line at a time: a line that is not UTF-8 (JSON's encoding) is named.
        read = getattr(sys.stdin, "buffer", sys.stdin).readline
        number = 0
        # A line at a time in a thread: messages go out while a slow producer writes the next.
        while raw := await loop.run_in_executor(None, read):
            number += 1
            try:
                line = (raw.decode() if isinstance(raw, bytes) else raw).removeprefix("\ufeff")  # a BOM
            except UnicodeDecodeError:
                raise InvalidInputError(f"line {number} is not UTF-8 text") from None
            if line.strip():
                yield number, f"line {number}", line

    async def work(client: AsyncClient) -> None:
        nonlocal last_read, stopped_early
        pending: deque[tuple[int, asyncio.Future[Any]]] = deque()

        def settle() -> None:
            """Take the answered messages in order: print the ids, note the refused."""
            while pending and pending[0][1].done():
                number, future = pending.popleft()
                if (exc := future.exception()) is not None:
                    refused.append((number, exc))
                else:
                    ids.append(str(future.result()))
                    if not as_json:
                        typer.echo(ids[-1])

        try:
            async with AsyncPublisher(client) as publisher:
                try:
                    async for number, what, text in lines():
                        last_read = number
                        try:
                            payload = _payload(text, what)
                            pending.append((number, publisher.publish(topic_id, payload, **options)))
                        except (InvalidInputError, ValueError, TypeError) as exc:
                            problem = _problem(exc)
                            stopped.append(
                                problem if isinstance(exc, InvalidInputError) else f"{what}: {problem}"
                            )
                            stopped_early = True
                            break
                        settle()
                        if refused:  # stop reading; what was read already is still sent
                            stopped_early = True
                            break
                except InvalidInputError as exc:  # stdin itself: a line that is not text
                    stopped.append(exc.message)
                    stopped_early = True
        finally:
            settle()  # leaving the publisher answered everything (or failed it)

    answered = False
    try:
        _call(url, work)
        answered = True
    finally:
        # What was published is printed, even when something failed after it.
        if as_json and (ids or (answered and not (refused or stopped))):
            typer.echo(_dump({"message_ids": ids}))
    if refused or stopped:
        raise _publish_failure(
            message == "-", len(ids), refused, stopped, last_read if stopped_early else None
        )


def _publish_failure(
    from_stdin: bool,
    published: int,
    refused: list[tuple[int, BaseException]],
    stopped: list[str],
    last_read: int | None,
) -> typer.Exit:
    """One line for a publish that did not publish everything: what failed, and what was published."""
    if refused:
        first = refused[0][1]
        problem, code = cli.describe_error(first)
        if from_stdin:
            # The server counts a message's place in its request ("message at index 2"): name its line.
            batch = [number for number, exc in refused if exc is first]
            place = re.match(r"message at index (\d+)\b", problem)
            if place is not None and int(place[1]) < len(batch):
                problem = f"the message of line {batch[int(place[1])]}" + problem[place.end() :]
            problem = problem.removesuffix("; nothing was published")
            # Where the answer was lost (the server out of reach, a proxy's 502 or 504)
            # the messages may have been stored: those lines are not confirmed either way.
            unsure = [number for number, exc in refused if _answer_lost(exc)]
            sure = [number for number, exc in refused if not _answer_lost(exc)]
            if sure:
                problem += f"; not published: {_lines(sure)}"
            if unsure:
                problem += f"; not confirmed (published or not): {_lines(unsure)}"
    else:
        problem, code = stopped[0], cli.EXIT_CODES[InvalidInputError]
    if stopped and refused:
        problem += f"; {stopped[0]}"
    if from_stdin:
        verb = "was" if published == 1 else "were"
        if refused:
            if last_read is not None:
                problem += f"; reading stopped at line {last_read}"
            problem += f"; {_count(published, 'message')} {verb} published (ids printed)"
        elif published:  # a bad line stopped it: everything before it was published
            problem += f"; the {_count(published, 'message')} before it {verb} published"
    return cli.fail(problem, code)


def _answer_lost(exc: BaseException) -> bool:
    """Whether a request's fate is unknown: no answer came, or a proxy answered for the server."""
    from fastpubsub.client.errors import APIError

    if isinstance(exc, ServerUnavailableError):
        return getattr(exc, "sent", True)  # one never sent was not published
    return isinstance(exc, APIError) and exc.status in (500, 502, 504)


def _lines(numbers: list[int]) -> str:
    """Line numbers as ranges: "lines 3-5, 9" (or "line 3")."""
    ranges: list[list[int]] = []
    for number in sorted(numbers):
        if ranges and number == ranges[-1][1] + 1:
            ranges[-1][1] = number
        else:
            ranges.append([number, number])
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in ranges)
    return f"line {text}" if len(numbers) == 1 else f"lines {text}"


def pull(
    subscription_id: SubscriptionArg,
    max_messages: Annotated[int, typer.Option("--max", min=1, max=100, help="Messages at most")] = 10,
    wait: Annotated[
        float, typer.Option(min=0, max=30, help="Wait up to this many seconds for a message")
    ] = 0,
    ack: Annotated[bool, typer.Option("--ack", help="Ack what was pulled")] = False,
    url: Url = None,
    as_json: Json = False,
) -> None:
    """Lease messages and print them; --ack acks them, otherwise their leases run out."""

    async def work(client: AsyncClient) -> list[MessageOut]:
        messages = await client.pull(subscription_id, max_messages, wait_seconds=wait)
        if ack and messages:
            await client.ack(subscription_id, [m.id for m in messages])
        return messages

    messages = _call(url, work)
    _messages(messages, as_json, "(no messages)")
    if messages:
        note = "acked" if ack else "leased until the ack deadline (--ack to ack them)"
        typer.echo(f"{_count(len(messages), 'message')} {note}", err=True)


def tail(
    subscription_id: SubscriptionArg,
    max_in_flight: Annotated[int, typer.Option(min=1, max=1000, help="Unacked messages at most")] = 100,
    url: Url = None,
    as_json: Json = False,
) -> None:
    """Stream messages as they come, print and ack each, until Ctrl+C."""
    import asyncio

    from fastpubsub.client import AsyncSubscriber

    reader_left = False

    async def work(client: AsyncClient) -> int:
        subscriber = AsyncSubscriber(client)

        async def show(message: MessageOut) -> None:
            nonlocal reader_left
            try:
                if as_json:
                    typer.echo(_dump(_jsonable(message)))
                else:
                    created = message.created_at.isoformat(timespec="milliseconds")
                    typer.echo(f"{created}  {message.id}  {_dump(message.payload)}")
            except BrokenPipeError:
                # Our reader left (`| head`): stop, and give this message back
                # unsettled (closing cancels this callback), not nacked.
                reader_left = True
                stopping.append(asyncio.get_running_loop().create_task(subscriber.aclose(0)))
                await asyncio.Event().wait()

        stopping: list[asyncio.Task[None]] = []
        consumer = await subscriber.subscribe(
            subscription_id, show, max_messages=max_in_flight, concurrency=1, shutdown_timeout=5
        )
        typer.echo(f"streaming {subscription_id}; Ctrl+C stops", err=True)
        await subscriber.run()
        return consumer.stats.acked

    sdk_log = logging.getLogger("fastpubsub.client")
    said = _SayOnce()
    sdk_log.addHandler(said)
    sdk_log.propagate = False
    try:
        acked = _call(url, work)
    finally:
        sdk_log.removeHandler(said)
        sdk_log.propagate = True
    if reader_left:
        raise BrokenPipeError  # main() ends quietly, as for any command whose reader left
    typer.echo(f"stopped; {_count(acked, 'message')} acked", err=True)


class _SayOnce(logging.Handler):
    """The SDK's warnings as `warning: ...` lines, a repeat of the last one left out; its errors
    not at all (the command's own error line says what stopped it)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.last: str | None = None

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if record.levelno < logging.ERROR and text != self.last:
            self.last = text
            typer.echo(f"warning: {text}", err=True)


# -- dead letters ----------------------------------------------------------------------------------


@dlq_app.command("list")
def dlq_list(
    subscription_id: SubscriptionArg,
    url: Url = None,
    as_json: Json = False,
    offset: Offset = 0,
    limit: Limit = 100,
) -> None:
    """Dead letters, oldest first."""
    messages = _call(url, lambda client: client.list_dlq(subscription_id, offset, limit))
    _messages(messages, as_json, "(no dead letters)")


@dlq_app.command("reprocess")
def dlq_reprocess(
    subscription_id: SubscriptionArg,
    ids: Annotated[list[str] | None, typer.Argument(help="Message ids (see dlq list)")] = None,
    every: Annotated[bool, typer.Option("--all", help="Every dead letter of the subscription")] = False,
    url: Url = None,
) -> None:
    """Make dead letters deliverable again, attempts reset."""
    from uuid import UUID

    if bool(ids) == every:
        raise _invalid("give message ids or --all (not both)")
    try:
        chosen = list(dict.fromkeys(UUID(value) for value in ids or []))  # each once
    except ValueError:
        raise _invalid("message ids are UUIDs (see fastpubsub dlq list)") from None

    async def work(client: AsyncClient) -> int:
        if not every:
            await client.reprocess_dlq(subscription_id, chosen)
            return len(chosen)
        done = 0
        # Each round takes the oldest page; reprocessed ones leave the DLQ. Bounded: a
        # message dead-lettered again meanwhile waits for the next run.
        for _ in range(10_000):
            page = await client.list_dlq(subscription_id, 0, 1000)
            if not page:
                break
            await client.reprocess_dlq(subscription_id, [m.id for m in page])
            done += len(page)
        return done

    done = _call(url, work)
    if every:
        typer.echo(f"reprocessed {_count(done, 'dead letter')}")
    else:  # the server does not say which of them were dead letters
        typer.echo(
            f"asked to reprocess {_count(done, 'message')}: whichever are in the dead-letter queue are "
            "deliverable again, any other is left as it was"
        )


def register(app: typer.Typer) -> None:
    """Add the data-plane commands to the `fastpubsub` command line."""
    app.add_typer(topics_app, name="topics")
    app.add_typer(subscriptions_app, name="subscriptions")
    app.command("publish")(publish)
    app.command("pull")(pull)
    app.command("tail")(tail)
    app.add_typer(dlq_app, name="dlq")
