"""How a route is declared: with the access rule its guard enforces, or not at all."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.routing import APIRoute

from fleetline.api.auth import Authenticator
from fleetline.api.rbac import Principal, Rule, authorize
from fleetline.errors import AuthenticationError, PermissionDenied

log = logging.getLogger(__name__)


class Routes:
    """Declares the app's routes, each with the access rule its guard enforces."""

    def __init__(self, app: FastAPI, authenticator: Authenticator) -> None:
        self.app = app
        self.authenticator = authenticator
        self.rules: dict[tuple[str, str], Rule] = {}

    def __call__(
        self, method: str, path: str, rule: Rule, **kwargs: Any
    ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        self.rules[(method, path)] = rule
        return self.app.api_route(
            path, methods=[method], dependencies=[Depends(self._guard(rule))], **kwargs
        )

    def _guard(self, rule: Rule) -> Callable[[Request], Principal]:
        def check(request: Request) -> Principal:
            try:
                principal = self.authenticator.authenticate(request.headers.get("authorization"))
            except AuthenticationError as exc:
                request.state.refusal = str(exc)
                log.warning("refused %s %s: %s", request.method, request.url.path, exc)
                raise HTTPException(401, str(exc), headers={"WWW-Authenticate": "Bearer"}) from None
            request.state.principal = principal
            # The tenant a request reaches for: in its path (/v1/jobs/{tenant}/...) or asked
            # for with ?tenant=.
            requested = request.path_params.get("tenant") or request.query_params.get("tenant")
            try:
                request.state.scope = authorize(principal, rule, requested)
            except PermissionDenied as exc:
                request.state.refusal = str(exc)
                log.warning(
                    "denied %s %s to %s: %s",
                    request.method,
                    request.url.path,
                    principal.subject,
                    exc,
                )
                raise HTTPException(403, str(exc)) from None
            return principal

        return check

    def unruled(self) -> list[str]:
        """Routes served without an access rule (there must be none)."""
        return [
            f"{sorted(r.methods or ())[0]} {r.path}"
            for r in self.app.routes
            if isinstance(r, APIRoute) and (sorted(r.methods or ())[0], r.path) not in self.rules
        ]
