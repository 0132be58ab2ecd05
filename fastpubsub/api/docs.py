"""Swagger UI and ReDoc served with their assets from this server, not from a CDN.

Networks that run PostgreSQL-backed services are often closed to the internet;
the interactive docs must still work there. The pages are FastAPI's own, pointed
at scripts and styles shipped in the `fastapi-offline` package and mounted under
`/docs-assets`.
"""

from __future__ import annotations

from importlib import resources
from typing import Any

from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

ASSETS = "/docs-assets"
OAUTH2_REDIRECT = "/docs/oauth2-redirect"


def install(app: FastAPI, *, init_oauth: dict[str, Any]) -> None:
    """Add /docs, /docs/oauth2-redirect, /redoc and their assets (the app is built with docs_url=None)."""
    assets = resources.files("fastapi_offline") / "static"
    app.mount(ASSETS, StaticFiles(directory=str(assets)), name="docs-assets")

    def prefix(request: Request) -> str:
        return str(request.scope.get("root_path", "")).rstrip("/")

    @app.get("/docs", include_in_schema=False)
    async def swagger_ui(request: Request) -> HTMLResponse:
        root = prefix(request)
        return get_swagger_ui_html(
            openapi_url=f"{root}{app.openapi_url}",
            title=f"{app.title} - Swagger UI",
            swagger_js_url=f"{root}{ASSETS}/swagger-ui-bundle.js",
            swagger_css_url=f"{root}{ASSETS}/swagger-ui.css",
            swagger_favicon_url=f"{root}{ASSETS}/favicon.png",
            oauth2_redirect_url=f"{root}{OAUTH2_REDIRECT}",
            init_oauth=init_oauth,
        )

    @app.get(OAUTH2_REDIRECT, include_in_schema=False)
    async def swagger_ui_redirect() -> HTMLResponse:
        return get_swagger_ui_oauth2_redirect_html()

    @app.get("/redoc", include_in_schema=False)
    async def redoc(request: Request) -> HTMLResponse:
        root = prefix(request)
        return get_redoc_html(
            openapi_url=f"{root}{app.openapi_url}",
            title=f"{app.title} - ReDoc",
            redoc_js_url=f"{root}{ASSETS}/redoc.standalone.js",
            redoc_favicon_url=f"{root}{ASSETS}/favicon.png",
            with_google_fonts=False,
        )
