"""The operators' console: static files (HTML, our JavaScript and CSS, and the vendored uPlot
chart library) served under /ui by `fleetline serve`. The files hold no data; every number on
a page comes from the API with the signed-in user's bearer token."""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import RedirectResponse
from fastapi.staticfiles import StaticFiles
from starlette.requests import Request

STATIC = Path(__file__).parent / "static"
# The chart library, vendored from its npm package (see static/vendor/README.md).
UPLOT = "vendor/uplot-1.6.32.iife.min.js"


def mount_console(app: FastAPI, prefix: str) -> None:
    """Serve the console under `prefix`, and send `/` there."""
    app.mount(prefix, StaticFiles(directory=STATIC, html=True), name="console")

    async def home(request: Request) -> RedirectResponse:
        return RedirectResponse(f"{prefix}/")

    app.add_route("/", home, include_in_schema=False)
