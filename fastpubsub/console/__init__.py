"""The web console under /console: backlog at a glance, dead letters, clients (server-rendered HTML).

Its pages read and change everything through the API's route functions; its
assets ship in this package (no CDN, no build step); reading works with
JavaScript off, and a little script only refreshes the figures in place.
"""

from __future__ import annotations

from importlib import resources

from fastapi import FastAPI
from fastapi.staticfiles import StaticFiles
from starlette.routing import BaseRoute

from fastpubsub.console.history import History

PREFIX = "/console"
ASSETS = PREFIX + "/static"


def is_console(path: str) -> bool:
    """Whether `path` is the console's (it checks its own cookie session and CSRF tokens)."""
    return path == PREFIX or path.startswith(PREFIX + "/")


def install(app: FastAPI) -> list[BaseRoute]:
    """Add the console's pages and assets; returns its routes (for the Allow header of a 405)."""
    from fastpubsub.console import views

    app.mount(ASSETS, StaticFiles(directory=str(resources.files(__name__) / "static")), name="console-assets")
    app.include_router(views.router)
    app.state.console_history = None
    return list(views.router.routes)


async def stop(app: FastAPI) -> None:
    """Stop sampling for the charts (when the console was used)."""
    samples: History | None = getattr(app.state, "console_history", None)
    if samples is not None:
        await samples.stop()
