"""The operators' console: static files (HTML, our JavaScript and CSS, and the vendored uPlot
chart library) served under /ui by `fleetline serve`. The files hold no data; every number on
a page comes from the API with the signed-in user's bearer token."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, RedirectResponse
from fastapi.staticfiles import StaticFiles
from starlette.requests import Request

STATIC = Path(__file__).parent / "static"
# The chart library, vendored from its npm package (see static/vendor/README.md).
UPLOT = "vendor/uplot-1.6.32.iife.min.js"


SIGN_IN = "/v1/sign-in"


def mount_console(app: FastAPI, prefix: str, sign_in: dict[str, Any] | None) -> None:
    """Serve the console under `prefix`, send `/` there, and say at SIGN_IN how to sign in
    through the identity provider (its issuer and the console's and CLI's public clients; no
    secret, so it is served to anyone, as the provider's own discovery document is)."""

    async def sign_in_document(request: Request) -> JSONResponse:
        return JSONResponse(sign_in or {"issuer": None})

    app.add_route(SIGN_IN, sign_in_document, include_in_schema=False)
    app.mount(prefix, StaticFiles(directory=STATIC, html=True), name="console")

    async def home(request: Request) -> RedirectResponse:
        return RedirectResponse(f"{prefix}/")

    app.add_route("/", home, include_in_schema=False)
