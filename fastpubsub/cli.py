"""The `fastpubsub` command line: server, migrations, cleanup jobs, client admin, dev mode.

Errors print one line on stderr and exit non-zero (see EXIT_CODES); --verbose
adds the traceback. Heavy modules are imported inside commands so that `--help`
and the cron jobs start fast.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import re
import shlex
import shutil
import signal
import sys
import traceback
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from pathlib import Path
from typing import Annotated, Any, TypeVar
from uuid import UUID

import typer
from pydantic import ValidationError
from typer.core import TyperGroup

from fastpubsub.dev import DevServer
from fastpubsub.exceptions import (
    AlreadyExistsError,
    AuthenticationError,
    BacklogFullError,
    ConfigurationError,
    DatabaseUnavailableError,
    EmbeddedDatabaseError,
    FastPubSubError,
    InvalidInputError,
    NotFoundError,
    PayloadTooLargeError,
    PermissionDeniedError,
    ServerUnavailableError,
    StatementTimeoutError,
)
from fastpubsub.settings import MAX_SQL_INTEGER, Settings, bare_host, describe_invalid, get_settings

T = TypeVar("T")

EXIT_CODES: dict[type[FastPubSubError], int] = {
    InvalidInputError: 2,
    PayloadTooLargeError: 2,
    NotFoundError: 3,
    AlreadyExistsError: 4,
    DatabaseUnavailableError: 5,
    StatementTimeoutError: 5,
    ServerUnavailableError: 5,
    ConfigurationError: 6,
    EmbeddedDatabaseError: 6,
    AuthenticationError: 7,
    PermissionDeniedError: 7,
    BacklogFullError: 8,
}

_state = {"verbose": False}


def _exit_code(exc: FastPubSubError) -> int:
    return next((code for kind, code in EXIT_CODES.items() if isinstance(exc, kind)), 1)


def describe_error(exc: BaseException) -> tuple[str, int]:
    """One line for the user and the exit code, for any error a command may meet."""
    from sqlalchemy.exc import ArgumentError

    from fastpubsub.db.errors import connection_reason, driver_error, first_line, translate_error

    translated = translate_error(exc)
    if isinstance(translated, DatabaseUnavailableError) and driver_error(exc) is not None:
        # libpq's text names the server and why it failed; it never holds the password.
        reason = connection_reason(exc)
        if reason:
            return f"the database is unavailable ({reason}); retry shortly", _exit_code(translated)
    if translated is not None:
        return translated.message, _exit_code(translated)
    if (driver := driver_error(exc)) is not None:
        return f"database error: {first_line(str(driver))}", 1
    if isinstance(exc, ArgumentError):
        return f"not a database URL: {first_line(str(exc))}", EXIT_CODES[ConfigurationError]
    return f"unexpected {type(exc).__name__}: {first_line(str(exc))} (--verbose shows where)", 1


# Click's exception classes, from whichever click Typer runs on (recent Typer
# versions vendor their own copy).
_CLICK_ERRORS = {cls.__name__: cls for cls in typer.BadParameter.__mro__}
_ClickException: type[Exception] = _CLICK_ERRORS["ClickException"]
_UsageError: type[Exception] = _CLICK_ERRORS["UsageError"]


def _usage_message(exc: Any) -> str:
    message = " ".join(str(exc.format_message()).split()).rstrip(".")
    ctx = getattr(exc, "ctx", None)
    if isinstance(exc, _UsageError) and ctx is not None:
        message += f"; see '{ctx.command_path} --help'"
    return message


@contextlib.contextmanager
def _one_line_errors() -> Iterator[None]:
    """Any error becomes one line on stderr and an exit code (the traceback only with --verbose)."""
    try:
        yield
    except (typer.Exit, typer.Abort):
        raise  # normal exits and Ctrl+C
    except BrokenPipeError:
        raise  # our reader left (`| head`): main() ends quietly (drivers wrap their own sockets' errors)
    except (_ClickException, typer.TyperException) as exc:
        if type(exc).__name__ == "NoArgsIsHelpError":
            raise  # a bare group shows its help
        # usage errors: unknown command or option, bad option value, missing argument
        typer.echo(f"error: {_usage_message(exc)}", err=True)
        raise typer.Exit(getattr(exc, "exit_code", 2)) from None
    except Exception as exc:
        if _state["verbose"]:
            traceback.print_exc()
        message, code = describe_error(exc)
        typer.echo(f"error: {message}", err=True)
        raise typer.Exit(code) from None


class _Group(TyperGroup):
    """The top-level group: usage errors and anything unexpected are reported in one line."""

    def make_context(self, info_name: str | None, args: list[str], parent: Any = None, **extra: Any) -> Any:
        with _one_line_errors():
            return super().make_context(info_name, args, parent, **extra)

    def invoke(self, ctx: Any) -> Any:
        with _one_line_errors():
            return super().invoke(ctx)


app = typer.Typer(
    cls=_Group,
    help="fastpubsub: publish/subscribe messaging inside PostgreSQL.",
    no_args_is_help=True,
    context_settings={"help_option_names": ["-h", "--help"]},
    pretty_exceptions_enable=False,
    add_completion=False,
)


def _show_version(given: bool) -> None:
    if given:
        from fastpubsub import __version__

        typer.echo(f"fastpubsub {__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Show tracebacks on errors")] = False,
    version: Annotated[
        bool, typer.Option("--version", callback=_show_version, is_eager=True, help="Show the version")
    ] = False,
) -> None:
    _state["verbose"] = verbose


def fail(message: str, code: int = 1) -> typer.Exit:
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(code)


def run(coro_factory: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Run a coroutine; turn any error into one line on stderr and an exit code."""
    try:
        return asyncio.run(coro_factory())
    except (typer.Exit, typer.Abort):
        raise
    except BrokenPipeError:
        raise  # our reader left (`| head`): main() ends quietly (drivers wrap their own sockets' errors)
    except Exception as exc:
        if _state["verbose"]:
            traceback.print_exc()
        message, code = describe_error(exc)
        raise fail(message, code) from None


# What Kubernetes puts in every pod for a Service named fastpubsub (or fastpubsub-...),
# unless the pod says enableServiceLinks: false: no misspellings, so no warnings.
# Told apart by their values too: a bare <SERVICE>_PORT of 9000 is still warned of.
_SERVICE_LINK = re.compile(
    r"FASTPUBSUB(?:_\w+?)?_(?:SERVICE_HOST|SERVICE_PORT(?:_\w+)?|PORT(?:_\d+_(?:TCP|UDP|SCTP)(?:_\w+)?)?)"
)


def _service_link(name: str, value: str) -> bool:
    """Whether a variable is one Kubernetes sets for a Service: its name's shape and its value's."""
    import ipaddress

    if not _SERVICE_LINK.fullmatch(name):
        return False
    if name.endswith(("_SERVICE_HOST", "_ADDR")):
        try:
            ipaddress.ip_address(value)
        except ValueError:
            return False
        return True
    if name.endswith("_PROTO"):
        return value in ("TCP", "UDP", "SCTP", "tcp", "udp", "sctp")
    if re.search(r"_SERVICE_PORT(?:_\w+)?$|_(?:TCP|UDP|SCTP)_PORT$", name):
        return value.isdigit()  # <SERVICE>_SERVICE_PORT, ..._SERVICE_PORT_HTTP, ..._8000_TCP_PORT
    # <SERVICE>_PORT and <SERVICE>_PORT_8000_TCP: tcp://10.0.0.1:8000
    return re.fullmatch(r"(?:tcp|udp|sctp)://\S+", value, re.IGNORECASE) is not None


# Variables already warned of in this process (commands may read the settings twice).
_WARNED: set[str] = set()


def _warn_of_unknown_variables() -> None:
    """A FASTPUBSUB_ variable that names no setting (a misspelling, say) is ignored: say so.

    Those of the environment and those of the `.env` file the settings read.
    """
    import difflib

    known = {f"FASTPUBSUB_{name.upper()}" for name in Settings.model_fields}
    for name, value, where in _variables():
        spelt = name.upper()
        if (
            spelt.startswith("FASTPUBSUB_")
            and spelt not in known
            and not spelt.startswith("FASTPUBSUB_TEST_")
            and not _service_link(spelt, value)
        ):
            if name in _WARNED:
                continue
            _WARNED.add(name)
            prefix = len("FASTPUBSUB_")  # compared without it: every name shares it
            close = difflib.get_close_matches(spelt[prefix:], [k[prefix:] for k in known], n=1)
            hint = f" (did you mean FASTPUBSUB_{close[0]}?)" if close else ""
            typer.echo(f"warning: {name}{where} is not a fastpubsub setting and is ignored{hint}", err=True)


def _variables() -> list[tuple[str, str, str]]:
    """(name, value, where) of each variable of the environment, then of the `.env` file not set there."""
    variables = [(name, os.environ[name], "") for name in sorted(os.environ)]
    env_file = Path(str(Settings.model_config.get("env_file") or ""))
    if env_file.name and env_file.is_file():
        from dotenv import dotenv_values

        said = logging.getLogger("dotenv.main")  # a line it cannot parse: the settings say so too
        was_disabled, said.disabled = said.disabled, True
        try:
            in_file = dotenv_values(env_file)
        except (OSError, UnicodeDecodeError):
            return variables  # the settings say what is wrong with it
        finally:
            said.disabled = was_disabled
        variables += [
            (name, value or "", f" (in {env_file})")
            for name, value in sorted(in_file.items())
            if name not in os.environ
        ]
    return variables


def _settings() -> Settings:
    _warn_of_unknown_variables()
    env_file = str(Settings.model_config.get("env_file") or ".env")
    said = logging.getLogger("dotenv.main")  # a line of the file it cannot parse: said with the file's name
    heard = _EnvFileWarnings(env_file)
    said.addHandler(heard)
    was_propagating, said.propagate = said.propagate, False
    try:
        return get_settings()
    except ValidationError as exc:
        raise fail(f"invalid configuration: {describe_invalid(exc)}", 6) from None
    except UnicodeDecodeError as exc:
        problem = f"{env_file} is not UTF-8 text ({exc.reason} at byte {exc.start})"
        raise fail(f"invalid configuration: {problem}", 6) from None
    except ValueError as exc:
        raise fail(f"invalid configuration: {exc}".replace("\n", " "), 6) from None
    finally:
        said.removeHandler(heard)
        said.propagate = was_propagating


class _EnvFileWarnings(logging.Handler):
    """What the `.env` reader says of a line it skips, as a warning naming the file."""

    def __init__(self, env_file: str) -> None:
        super().__init__(logging.WARNING)
        self.env_file = env_file

    def emit(self, record: logging.LogRecord) -> None:
        typer.echo(f"warning: {self.env_file}: {record.getMessage()} (the line is ignored)", err=True)


def _database_url(settings: Settings) -> str:
    """FASTPUBSUB_DATABASE_URL, or else the database of the `fastpubsub dev` running here."""
    if not settings.database_url:
        running = _dev_server(settings)
        from fastpubsub.db.urls import mask_url

        typer.echo(f"using the database of the dev server: {mask_url(running.database_url)}", err=True)
        return running.database_url
    from fastpubsub.db.urls import sync_url

    try:
        sync_url(settings.database_url)
    except Exception:
        # Never echo the value: it may hold a password in a form nothing can mask.
        raise fail(
            "FASTPUBSUB_DATABASE_URL is not a PostgreSQL URL "
            "(expected postgresql://USER:PASSWORD@HOST:5432/DATABASE)",
            EXIT_CODES[ConfigurationError],
        ) from None
    return settings.database_url


def _dev_server(settings: Settings) -> DevServer:
    """The `fastpubsub dev` running from this directory; fails saying how to start one."""
    from fastpubsub import dev as dev_record

    running = dev_record.find(settings.embedded_data_dir)
    if running is None:
        raise fail(
            "FASTPUBSUB_DATABASE_URL is not set and no `fastpubsub dev` is running here "
            f"(none recorded in {settings.embedded_data_dir.resolve()}): start one with `make run` "
            "in another terminal, or set FASTPUBSUB_DATABASE_URL",
            EXIT_CODES[ConfigurationError],
        )
    return running


async def _with_database(settings: Settings, work: Callable[[Any], Awaitable[T]]) -> T:
    from fastpubsub.db import Database

    database = Database(_database_url(settings), pool_size=1, max_overflow=1)
    try:
        return await work(database)
    finally:
        await database.close()


def _parse_bool(value: str) -> bool:
    lowered = value.strip().lower()
    if lowered in ("true", "1", "yes", "y", "on"):
        return True
    if lowered in ("false", "0", "no", "n", "off"):
        return False
    raise fail(f'IS_ACTIVE must be true or false, not "{value}"', EXIT_CODES[InvalidInputError])


def _parse_client_id(value: str) -> UUID:
    try:
        return UUID(value)
    except ValueError:
        raise fail(f'"{value}" is not a client id (a UUID)', EXIT_CODES[InvalidInputError]) from None


# ---------------------------------------------------------------------------
# Server
# ---------------------------------------------------------------------------


def _gunicorn_logging(settings: Settings) -> dict[str, Any]:
    formatter = "JsonFormatter" if settings.log_format == "json" else "TextFormatter"
    level = settings.log_level.upper()
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"fastpubsub": {"()": f"fastpubsub.logs.{formatter}"}},
        "handlers": {"stderr": {"class": "logging.StreamHandler", "formatter": "fastpubsub"}},
        "root": {"handlers": ["stderr"], "level": level},
        "loggers": {
            "gunicorn.error": {"handlers": ["stderr"], "level": level, "propagate": False},
            "gunicorn.access": {"handlers": [], "propagate": False},
        },
    }


def serve(settings: Settings, host: str, port: int, workers: int) -> None:
    """Run the API under gunicorn with uvicorn workers until stopped."""
    from gunicorn.app.base import BaseApplication

    from fastpubsub import metrics_folder

    # Prometheus counters are summed across workers through this directory; it
    # must be set before any worker imports prometheus_client. (Those of killed
    # servers are removed first.)
    metrics_dir, metrics_lock = metrics_folder.claim()
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(metrics_dir)
    # The application's modules are imported here, once, and each worker
    # forked from this process starts with them: it then only builds the app
    # (a worker that imported them itself spent 0.6-0.7 s of CPU on it, again
    # for each worker and for each one restarted after a crash).
    # Nothing is built or connected before the fork: load() runs in the worker.
    import fastpubsub.api.app
    import fastpubsub.console.views  # noqa: F401  (imported by the app when it is built)

    def child_exit(server: Any, worker: Any) -> None:
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(worker.pid)  # type: ignore[no-untyped-call]

    options = {
        # An IPv6 address goes in brackets ("[::1]:8000"), given with them or not.
        "bind": f"[{bare_host(host)}]:{port}" if ":" in host else f"{host}:{port}",
        "workers": workers,
        "worker_class": "fastpubsub.api.worker.Worker",
        # Long-polls last up to 30 s: give requests room before a worker is recycled.
        "timeout": 90,
        # On stop, workers end long-polls and streams at once and give other
        # requests FASTPUBSUB_API_GRACEFUL_SECONDS; the master waits a little longer.
        "graceful_timeout": math.ceil(settings.api_graceful_seconds) + 5,
        "keepalive": 75,
        "loglevel": settings.log_level,
        "accesslog": None,
        "child_exit": child_exit,
        "proc_name": "fastpubsub",
        "control_socket_disable": True,
        # gunicorn's own lines go through fastpubsub's formatter too.
        "logconfig_dict": _gunicorn_logging(settings),
    }

    class Server(BaseApplication):  # type: ignore[misc]  # gunicorn has no type information
        def load_config(self) -> None:
            for key, value in options.items():
                self.cfg.set(key, value)

        def load(self) -> Any:
            from fastpubsub.api.app import create_app_from_environment

            return create_app_from_environment()

    try:
        Server().run()
    finally:
        shutil.rmtree(metrics_dir, ignore_errors=True)
        os.close(metrics_lock)


_INSECURE_NO_AUTH = typer.Option(
    "--insecure-no-auth",
    help="Serve with auth off on an address other hosts can reach: anyone who reaches it may do "
    "anything [FASTPUBSUB_API_INSECURE_NO_AUTH]",
)


@app.command()
def server(
    host: Annotated[str | None, typer.Option(help="Bind address [FASTPUBSUB_API_HOST]")] = None,
    port: Annotated[int | None, typer.Option(min=1, max=65535, help="Port [FASTPUBSUB_API_PORT]")] = None,
    workers: Annotated[
        int | None, typer.Option(min=1, max=64, help="Worker processes [FASTPUBSUB_API_NUM_WORKERS]")
    ] = None,
    insecure_no_auth: Annotated[bool, _INSECURE_NO_AUTH] = False,
) -> None:
    """Serve the HTTP API (gunicorn with uvicorn workers)."""
    settings = _settings()
    _database_url(settings)
    if settings.auth_enabled:
        try:
            settings.require_auth_secret()
        except ConfigurationError as exc:
            raise fail(exc.message, EXIT_CODES[ConfigurationError]) from None
    host = host or settings.api_host
    _refuse_exposure(settings, host, insecure_no_auth)
    from fastpubsub.logs import configure_logging

    port = port or settings.api_port
    _refuse_unbindable(host, port, "--port", "--host")
    configure_logging(settings.log_level, settings.log_format)
    _warn_unless_migrated(settings.database_url or "")
    serve(settings, host, port, workers or settings.api_num_workers)


def _refuse_unbindable(host: str, port: int, port_option: str, host_option: str) -> None:
    """One line before anything starts when host:port cannot be listened on (in use, not an address here)."""
    import errno

    from fastpubsub.embedded import bind_error, os_reason

    error = bind_error(host, port)
    if error is not None:
        at_fault = port_option if error.errno in (errno.EADDRINUSE, errno.EACCES) else host_option
        raise fail(
            f"cannot listen on {host}:{port}: {os_reason(error)}; choose another with {at_fault}",
            EXIT_CODES[ConfigurationError],
        )


def _refuse_exposure(settings: Settings, host: str, insecure_no_auth: bool) -> None:
    """Refuse to serve with auth off where other hosts can reach, unless told it is meant."""
    if insecure_no_auth:
        settings = settings.model_copy(update={"api_insecure_no_auth": True})
    problem = settings.exposure_problem(host)
    if problem is not None:
        raise fail(problem, EXIT_CODES[ConfigurationError])


def _warn_unless_migrated(url: str, meanwhile: str = "/readiness answers 503 until then") -> None:
    """Say at start what /readiness will say: the server starts anyway, kept out of rotation by readiness.

    (The push-worker says what it does `meanwhile` instead.)
    """
    from fastpubsub import migrate

    try:
        problem = migrate.schema_expectation().problem(migrate.current_revision(url, connect_timeout=5))
    except Exception as exc:  # unreachable or refused: readiness reports that as it goes
        problem = describe_error(exc)[0]
    if problem is not None:
        logging.getLogger("fastpubsub.cli").warning("%s; %s", problem, meanwhile)


def _own_command() -> str:
    """How to run this very fastpubsub from the current directory: by name when PATH finds it."""
    import shutil

    running = Path(sys.argv[0]).resolve()
    if running.name != "fastpubsub":  # not the console script (python -c, a test runner)
        return "fastpubsub"
    found = shutil.which("fastpubsub")
    if found is not None and Path(found).resolve() == running:
        return "fastpubsub"
    try:
        relative = str(running.relative_to(Path.cwd().resolve()))
    except ValueError:
        return shlex.quote(str(running))
    return shlex.quote(relative if "/" in relative else f"./{relative}")


@app.command()
def dev(
    data_dir: Annotated[
        Path | None, typer.Option(help="Embedded database directory [FASTPUBSUB_EMBEDDED_DATA_DIR]")
    ] = None,
    reset: Annotated[bool, typer.Option(help="Delete the embedded database first")] = False,
    host: Annotated[
        str | None,
        typer.Option(help="Bind address, loopback unless auth is on [FASTPUBSUB_API_HOST or 127.0.0.1]"),
    ] = None,
    port: Annotated[int | None, typer.Option(min=1, max=65535, help="Port [FASTPUBSUB_API_PORT]")] = None,
    workers: Annotated[int, typer.Option(min=1, max=64, help="Worker processes")] = 1,
    insecure_no_auth: Annotated[bool, _INSECURE_NO_AUTH] = False,
) -> None:
    """Run locally: embedded PostgreSQL (unless FASTPUBSUB_DATABASE_URL is set), migrations, the API.

    Other commands run from the same directory find it (dev.json in the data directory).
    """
    from fastpubsub import dev as dev_record
    from fastpubsub import migrate
    from fastpubsub.db.urls import mask_url
    from fastpubsub.embedded import EmbeddedPostgres, port_free

    settings = _settings()
    host = host or settings.api_host
    port = port or settings.api_port
    _refuse_exposure(settings, host, insecure_no_auth)
    records_in = data_dir or settings.embedded_data_dir
    if (running_dev := dev_record.find(records_in)) is not None:
        raise fail(
            f"a dev server is already running from {records_in.resolve()} (pid {running_dev.pid}, "
            f"{running_dev.api_url}); stop it first",
            EXIT_CODES[ConfigurationError],
        )
    if not port_free(port, host):
        raise fail(
            f"port {port} is in use on {host}: choose another with --port (make run PORT=8080)",
            EXIT_CODES[ConfigurationError],
        )
    embedded = None
    url = settings.database_url
    if url:
        for given, option in ((reset, "--reset"), (data_dir is not None, "--data-dir")):
            if given:
                raise fail(
                    f"{option} is for the embedded database, but FASTPUBSUB_DATABASE_URL is set and dev "
                    "uses that database (and never deletes it); unset the variable to use the embedded one",
                    EXIT_CODES[InvalidInputError],
                )
        url = _database_url(settings)
    try:
        if not url:
            directory = records_in
            stable = dev_record.DATABASE_PORT
            embedded = EmbeddedPostgres(directory, preferred_port=stable)
            if reset:
                typer.echo(f"Deleting the embedded database in {directory.resolve()}")
                embedded.destroy()
            created = not embedded.initialized
            running = embedded.start()
            url = running.url()
            for changed in embedded.permission_changes:
                typer.echo(f"Made {changed} searchable (x) for the {embedded.user} user that runs PostgreSQL")
            if embedded.started:
                verb = "Created" if created else "Started"
                moved = "" if running.port == stable else f" ({stable} is taken)"
                typer.echo(
                    f"{verb} embedded PostgreSQL in {directory.resolve()} on port {running.port}{moved}"
                )
            else:
                typer.echo(
                    f"Using the PostgreSQL already running in {directory.resolve()} on port {running.port} "
                    "(started elsewhere: it keeps running when dev stops)"
                )
        migrate.upgrade(url)
        typer.echo(f"Database migrated to {migrate.head_revision()}")
    except Exception as exc:
        if _state["verbose"]:
            traceback.print_exc()
        message, code = describe_error(exc)
        prefix = "" if isinstance(exc, FastPubSubError) else "could not prepare the database: "
        raise fail(prefix + message, code) from None

    os.environ["FASTPUBSUB_DATABASE_URL"] = url
    os.environ.setdefault("FASTPUBSUB_LOG_FORMAT", "text")  # people read these logs
    get_settings.cache_clear()
    settings = _settings()
    api = dev_record.api_url(host, port)
    shown_url = url.replace("postgresql+psycopg://", "postgresql://", 1)
    typer.echo(f"Database {mask_url(shown_url)}")
    typer.echo(f"API      {api}")
    typer.echo(f"Docs     {api}/docs")
    # The other commands find this server through its record, in the data directory their settings name.
    elsewhere = records_in.resolve() != settings.embedded_data_dir.resolve()
    prefix = f"FASTPUBSUB_EMBEDDED_DATA_DIR={shlex.quote(str(records_in.resolve()))} " if elsewhere else ""
    where = "in another terminal, from this directory"
    typer.echo(f"CLI      {prefix}{_own_command()} topics list ({where})")
    stops_database = embedded is not None and embedded.started
    note = " (the embedded database stops too; its data stays)" if stops_database else ""
    typer.echo(f"Stop     Ctrl+C{note}")
    from fastpubsub.logs import configure_logging

    configure_logging(settings.log_level, settings.log_format)
    dev_record.record(records_in, dev_record.DevServer(shown_url, api, os.getpid()))
    try:
        serve(settings, host, port, workers)
    finally:
        dev_record.forget(records_in, os.getpid())
        if embedded is not None and embedded.started:
            embedded.stop()


# ---------------------------------------------------------------------------
# Database jobs
# ---------------------------------------------------------------------------


@app.command("db-migrate")
def db_migrate(
    revision: Annotated[str, typer.Option(help="Target revision")] = "head",
) -> None:
    """Apply database migrations (safe to run from several places at once)."""
    from alembic.util import CommandError

    from fastpubsub import migrate
    from fastpubsub.db.errors import first_line

    url = _database_url(_settings())
    if not revision.strip():
        raise fail("--revision is empty: name a revision, or head", EXIT_CODES[InvalidInputError])
    script = migrate.script_directory()
    try:
        target = script.get_revision(revision)
    except CommandError as exc:
        raise fail(f"migration failed: {first_line(str(exc))}", EXIT_CODES[InvalidInputError]) from None
    try:
        _refuse_going_back(url, script, target.revision if target is not None else None)
        migrate.upgrade(url, revision)
    except typer.Exit:
        raise
    except CommandError as exc:
        # The target is known (above): the revision alembic cannot place is the
        # database's own, made by a newer release.
        raise fail(f"migration failed: {first_line(str(exc))}", EXIT_CODES[ConfigurationError]) from None
    except Exception as exc:
        if _state["verbose"]:
            traceback.print_exc()
        message, code = describe_error(exc)
        raise fail(f"migration failed: {message}", code) from None
    typer.echo(f"database is at revision {migrate.current_revision(url)}")


def _refuse_going_back(url: str, script: Any, target: str | None) -> None:
    """Exit 2 when the database is past `target` (None: base): db-migrate only upgrades."""
    from alembic.script.revision import RevisionError
    from alembic.util import CommandError

    from fastpubsub import migrate

    current = migrate.current_revision(url)
    if current is None or current == target:
        return
    try:
        earlier = {r.revision for r in script.iterate_revisions(current, "base")}
    except (CommandError, RevisionError):
        return  # a revision of a newer release: upgrade says so
    if target is None or target in earlier:
        raise fail(
            f"the database is at revision {current}, past {target or 'base'}: db-migrate only upgrades",
            EXIT_CODES[InvalidInputError],
        )


@app.command("push-worker")
def push_worker(
    metrics_host: Annotated[
        str | None, typer.Option(help="Address /metrics is served on [FASTPUBSUB_PUSH_METRICS_HOST]")
    ] = None,
    metrics_port: Annotated[
        int | None,
        typer.Option(min=0, max=65535, help="Port of /metrics, 0 for none [FASTPUBSUB_PUSH_METRICS_PORT]"),
    ] = None,
    shutdown_grace: Annotated[
        float, typer.Option(min=0, help="On SIGTERM, seconds requests in flight may take to finish")
    ] = 5.0,
) -> None:
    """Deliver push subscriptions to their endpoints (run one or more; SIGTERM stops gracefully)."""
    settings = _settings()
    settings = settings.model_copy(update={"database_url": _database_url(settings)})
    from fastpubsub.logs import configure_logging

    port = settings.push_metrics_port if metrics_port is None else metrics_port
    host = metrics_host or settings.push_metrics_host
    if port:
        _refuse_unbindable(host, port, "--metrics-port", "--metrics-host")
    configure_logging(settings.log_level, settings.log_format)
    _warn_unless_migrated(settings.database_url or "", "nothing is pushed until then")

    async def work() -> None:
        from prometheus_client import CollectorRegistry, start_http_server

        from fastpubsub.push.worker import PushWorker

        registry = CollectorRegistry()
        if port:
            start_http_server(port, host, registry=registry)
            log = logging.getLogger("fastpubsub.cli")
            log.info("push-worker metrics on http://%s:%s/metrics", host, port)
        worker = PushWorker(settings, shutdown_grace=shutdown_grace, registry=registry)
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, worker.stop)
        await worker.run()

    run(work)


@app.command("cleanup-acked-messages")
def cleanup_acked_messages(
    older_than: Annotated[
        int | None,
        typer.Option(
            min=0, max=MAX_SQL_INTEGER, help="Seconds [FASTPUBSUB_CLEANUP_ACKED_MESSAGES_OLDER_THAN_SECONDS]"
        ),
    ] = None,
    batch_size: Annotated[
        int | None,
        typer.Option(min=1, max=1000000, help="Rows per transaction [FASTPUBSUB_CLEANUP_BATCH_SIZE]"),
    ] = None,
) -> None:
    """Delete acked deliveries, messages nothing needs any more and idempotency keys past a cut-off."""
    settings = _settings()
    seconds = settings.cleanup_acked_messages_older_than_seconds if older_than is None else older_than
    batch = batch_size or settings.cleanup_batch_size
    archived_in = None
    if settings.cleanup_acked_only_archived and settings.archive_uri:
        from fastpubsub.spark.launch import archive_destination

        archived_in = archive_destination(settings.archive_uri)
    result = run(
        lambda: _with_database(settings, lambda db: db.cleanup_acked(seconds, batch, archived_in=archived_in))
    )
    waited = f" (only what the archive {archived_in} holds)" if archived_in else ""
    typer.echo(
        f"deleted {result.acked_deleted} acked deliveries, {result.messages_deleted} messages "
        f"and {result.idempotency_keys_deleted} idempotency keys{waited}"
    )


@app.command("cleanup-stuck-messages")
def cleanup_stuck_messages(
    lock_timeout: Annotated[
        int | None,
        typer.Option(
            min=0,
            max=MAX_SQL_INTEGER,
            help="Seconds [FASTPUBSUB_CLEANUP_STUCK_MESSAGES_LOCK_TIMEOUT_SECONDS]",
        ),
    ] = None,
) -> None:
    """End leases that ran out and were taken longer ago than the lock timeout (never a live one)."""
    settings = _settings()
    seconds = settings.cleanup_stuck_messages_lock_timeout_seconds if lock_timeout is None else lock_timeout
    ended = run(lambda: _with_database(settings, lambda db: db.cleanup_stuck(seconds)))
    typer.echo(
        f"ended {ended.released + ended.dead_lettered} stuck leases: {ended.released} released "
        f"(deliverable again), {ended.dead_lettered} dead-lettered (no delivery attempt left)"
    )


# ---------------------------------------------------------------------------
# Secrets and clients
# ---------------------------------------------------------------------------


@app.command("generate-secret-key")
def generate_secret_key() -> None:
    """Print a new signing key for FASTPUBSUB_AUTH_SECRET_KEY."""
    from fastpubsub.auth import generate_signing_key

    typer.echo(f"new_secret={generate_signing_key()}")


@app.command("create-client")
def create_client(
    name: Annotated[str, typer.Argument(help="A name for people to recognise the client")],
    scopes: Annotated[
        str, typer.Argument(help="Space-separated scopes, e.g. '*' or 'topics:publish:orders'")
    ],
    is_active: Annotated[str, typer.Argument(help="true or false")] = "true",
) -> None:
    """Create an API client; prints client_id= and client_secret= (shown once)."""
    from uuid import uuid4

    from fastpubsub import auth

    settings = _settings()
    active = _parse_bool(is_active)
    _check_client_name(name)

    async def work() -> tuple[UUID, str]:
        parsed = auth.parse_scopes(scopes)
        secret = auth.generate_secret()
        secret_hash = await asyncio.to_thread(auth.hash_secret, secret)

        async def create(db: Any) -> Any:
            return await db.create_client(uuid4(), name, " ".join(parsed), active, secret_hash)

        client = await _with_database(settings, create)
        return client.id, secret

    client_id, secret = run(work)
    typer.echo(f"client_id={client_id}")
    typer.echo(f"client_secret={secret}")


@app.command("list-clients")
def list_clients(
    offset: Annotated[int, typer.Option(min=0, max=10_000_000)] = 0,
    limit: Annotated[int, typer.Option(min=1, max=1000)] = 100,
) -> None:
    """List API clients as a table."""
    settings = _settings()
    clients = run(lambda: _with_database(settings, lambda db: db.list_clients(offset, limit)))
    rows = [("ID", "NAME", "ACTIVE", "VERSION", "SCOPES")]
    rows += [
        (str(c.id), c.name, "yes" if c.is_active else "no", str(c.token_version), c.scopes) for c in clients
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    for row in rows:
        typer.echo("  ".join(value.ljust(widths[i]) for i, value in enumerate(row[:4])) + "  " + row[4])
    if not clients:
        typer.echo("(no clients)")


@app.command("update-client")
def update_client(
    client_id: Annotated[str, typer.Argument(help="Client id")],
    name: Annotated[str | None, typer.Option(help="New name")] = None,
    scopes: Annotated[str | None, typer.Option(help="New space-separated scopes")] = None,
    active: Annotated[bool | None, typer.Option("--active/--inactive", help="Enable or disable")] = None,
) -> None:
    """Change a client's name, scopes or state (revokes its earlier tokens)."""
    from fastpubsub import auth

    key = _parse_client_id(client_id)
    if name is not None:
        _check_client_name(name)
    if name is None and scopes is None and active is None:
        raise fail(
            "nothing to change: give --name, --scopes, --active or --inactive", EXIT_CODES[InvalidInputError]
        )
    settings = _settings()

    async def change(db: Any) -> Any:
        current = await db.get_client(key)
        new_scopes = " ".join(auth.parse_scopes(scopes)) if scopes is not None else current.scopes
        return await db.update_client(
            key,
            name if name is not None else current.name,
            new_scopes,
            active if active is not None else current.is_active,
        )

    client = run(lambda: _with_database(settings, change))
    typer.echo(
        f"updated client {client.id}: name={client.name} active={str(client.is_active).lower()} "
        f"scopes={client.scopes} token_version={client.token_version}"
    )


def _check_client_name(name: str) -> None:
    from fastpubsub.api.schemas import client_name_problem

    if (problem := client_name_problem(name)) is not None:
        raise fail(problem, EXIT_CODES[InvalidInputError])


@app.command("delete-client")
def delete_client(client_id: Annotated[str, typer.Argument(help="Client id")]) -> None:
    """Delete a client (its tokens stop working)."""
    key = _parse_client_id(client_id)
    settings = _settings()
    run(lambda: _with_database(settings, lambda db: db.delete_client(key)))
    typer.echo(f"deleted client {key}")


@app.command("rotate-client-secret")
def rotate_client_secret(client_id: Annotated[str, typer.Argument(help="Client id")]) -> None:
    """Give a client a new secret (shown once) and revoke its earlier tokens."""
    from fastpubsub import auth

    key = _parse_client_id(client_id)
    settings = _settings()

    async def work() -> str:
        secret = auth.generate_secret()
        secret_hash = await asyncio.to_thread(auth.hash_secret, secret)
        await _with_database(settings, lambda db: db.update_client_secret(key, secret_hash))
        return secret

    secret = run(work)
    typer.echo(f"client_id={key}")
    typer.echo(f"client_secret={secret}")


# ---------------------------------------------------------------------------
# Reporting (Spark)
# ---------------------------------------------------------------------------


_DatabaseUrl = Annotated[
    str | None, typer.Option(help="PostgreSQL URL [FASTPUBSUB_DATABASE_URL]", show_default=False)
]
_DownloadJdbc = Annotated[
    bool, typer.Option(help="Let Spark download the JDBC driver when no jar is found locally")
]
_Master = Annotated[str, typer.Option(help="Spark master: local[*], spark://HOST:7077, k8s://...")]
_Partitions = Annotated[int, typer.Option(min=1, max=1024, help="JDBC partitions per large table")]


def _uri_option(help: str) -> Any:
    """An optional directory or URI (no default to show)."""
    return typer.Option(help=help, show_default=False)


_Fetchsize = Annotated[int, typer.Option(min=1, help="JDBC fetch size (rows per round trip)")]


def _spark_job(
    name: str,
    master: str,
    database_url: str | None,
    download_jdbc: bool,
    prepare: Callable[[], T],
    work: Callable[[Any, Any, str, T, Any], str],
) -> None:
    """Run a Spark job from the CLI: checks first (one line each), progress on stderr, output on stdout.

    `prepare` checks the job's own options before Spark starts; `work(spark,
    target, url, prepared, progress)` does the job and returns what to print.
    """
    from fastpubsub.spark import launch

    settings = _settings()
    url = database_url or _database_url(settings)
    try:
        prepared = prepare()
        target = launch.to_jdbc(url)
        if launch.find_java() is None:
            raise ConfigurationError("no Java runtime found: install Java 17 or later, or set JAVA_HOME")
        driver = launch.find_jdbc_driver(settings.jdbc_jar, allow_download=download_jdbc)
        try:
            import pyspark  # noqa: F401
        except ImportError:
            raise ConfigurationError("PySpark is not installed: install the 'spark' extra") from None
        launch.check_database(url)
    except FastPubSubError as exc:
        raise fail(*describe_error(exc)) from None
    from pyspark.sql import SparkSession

    progress = launch.Progress()
    log = launch.jvm_log_path(name)
    progress("starting", f"Spark {master}, JDBC driver {driver.describe()} (Spark's own log: {log})")
    existing = SparkSession.getActiveSession()
    spark = None
    try:
        spark = launch.start_spark(master, driver, app_name=f"fastpubsub-{name}", jvm_log=log)
        progress("started", f"Spark {spark.sparkContext.master}; database {target.masked_url}")
        output = work(spark, target, url, prepared, progress)
    except FastPubSubError as exc:
        raise fail(*describe_error(exc)) from None
    except Exception as exc:
        if _state["verbose"]:
            traceback.print_exc()
        message, unreachable = launch.spark_error_message(exc)
        raise fail(f"{name} failed: {message}", 5 if unreachable else 1) from None
    finally:
        if spark is not None and existing is None:
            spark.stop()
    typer.echo(output)
    progress("done", f"{name} finished")


@app.command("report")
def report(
    since: Annotated[str, typer.Option(help="Window start: 30m, 24h, 7d or an ISO 8601 time")] = "24h",
    until: Annotated[str | None, typer.Option(help="Window end: same forms [now]")] = None,
    out: Annotated[Path, typer.Option(help="Directory for the reports")] = Path("reports"),
    archive: Annotated[
        str | None,
        _uri_option("An archive (directory or URI): the part of the window it holds is read from it"),
    ] = None,
    master: _Master = "local[*]",
    partitions: _Partitions = 4,
    fetchsize: _Fetchsize = 10000,
    database_url: _DatabaseUrl = None,
    download_jdbc: _DownloadJdbc = False,
) -> None:
    """Spark report: delivery outcomes, ack latency, throughput per hour (Parquet, CSV, PNG, Markdown)."""
    from fastpubsub.spark import launch

    def prepare() -> tuple[Any, Any, str | None]:
        start, end = launch.parse_window(since, until)
        if out.exists() and not out.is_dir():
            raise InvalidInputError(f"--out {out} is a file, not a directory for the reports")
        return start, end, launch.archive_destination(archive) if archive else None

    def work(spark: Any, target: Any, url: str, prepared: tuple[Any, Any, str | None], progress: Any) -> str:
        from fastpubsub.spark import report as job

        start, end, destination = prepared
        window = {"since": start, "until": end, "partitions": partitions, "fetchsize": fetchsize}
        return job.report_from(spark, target, url, destination, out, progress=progress, **window)

    _spark_job("report", master, database_url, download_jdbc, prepare, work)


@app.command("archive")
def archive(
    out: Annotated[
        str | None,
        _uri_option("The archive: a directory or any URI Spark can write [FASTPUBSUB_ARCHIVE_URI]"),
    ] = None,
    settle_seconds: Annotated[
        int, typer.Option(min=0, help="Archive nothing written less than this long ago")
    ] = 10,
    max_batches: Annotated[
        int, typer.Option(min=1, help="Stop after this many batches (a UTC day at most each)")
    ] = 1000,
    master: _Master = "local[*]",
    partitions: _Partitions = 4,
    fetchsize: _Fetchsize = 10000,
    database_url: _DatabaseUrl = None,
    download_jdbc: _DownloadJdbc = False,
) -> None:
    """Export acked deliveries and their messages to Parquet by date and topic, each exactly once."""
    from fastpubsub.spark import launch

    def prepare() -> str:
        where = out or _settings().archive_uri
        if not where:
            raise InvalidInputError("name the archive: --out DIR|URI or FASTPUBSUB_ARCHIVE_URI")
        return launch.archive_destination(where)

    def work(spark: Any, target: Any, url: str, destination: str, progress: Any) -> str:
        from fastpubsub.spark import archive as job

        batches = {"settle_seconds": settle_seconds, "max_batches": max_batches}
        reads = {"partitions": partitions, "fetchsize": fetchsize}
        return job.archive_to(spark, target, url, destination, progress=progress, **reads, **batches)

    _spark_job("archive", master, database_url, download_jdbc, prepare, work)


def _register_data_plane() -> None:
    from fastpubsub import data_cli

    data_cli.register(app)


_register_data_plane()


def _register_bench() -> None:
    from fastpubsub.bench.cli import bench_app

    app.add_typer(bench_app, name="bench")


_register_bench()

# The seed's spellings keep working (hidden from --help).
app.command("cleanup_acked_messages", hidden=True)(cleanup_acked_messages)
app.command("cleanup_stuck_messages", hidden=True)(cleanup_stuck_messages)
app.command("generate_secret_key", hidden=True)(generate_secret_key)
app.command("create_client", hidden=True)(create_client)
app.command("db_migrate", hidden=True)(db_migrate)


def main() -> None:
    """Console entry point."""
    # SIGPIPE stays ignored (Python's default): a server's workers inherit it,
    # and a client hanging up must cost them an EPIPE, never their life. A
    # reader of our output that stops early (`fastpubsub list-clients | head`)
    # ends the command quietly instead.
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)
    except BrokenPipeError:
        # Further writes (at exit too) would fail again: send them nowhere.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)
