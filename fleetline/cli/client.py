"""The API as the CLI reaches it: contexts (a server and the credentials for it) and calls made
with the caller's identity, so every write is authenticated, authorised, held to its tenant and
audited by the server exactly as any HTTP caller's (kubectl's model).

Contexts live in one YAML file, readable by its owner only (`FLEETLINE_CONTEXTS`, default
`~/.config/fleetline/contexts.yaml`):

    current: prod
    contexts:
      prod: {server: https://fleetline.example.com:8080, token: fl_..., ca: /etc/fleetline/ca.pem}

`FLEETLINE_CONTEXT` picks another context for one command; `FLEETLINE_SERVER` with
`FLEETLINE_TOKEN` (and `FLEETLINE_CA`) stands for a context without a file (automation).
"""

from __future__ import annotations

import json
import os
import ssl
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml

from fleetline.errors import (
    AuthenticationError,
    ConfigError,
    FleetlineError,
    PermissionDenied,
    ServiceUnavailable,
)

CONTEXTS_ENV = "FLEETLINE_CONTEXTS"


@dataclass(frozen=True)
class Context:
    name: str
    server: str
    token: str
    ca: str | None = None  # the PEM of the CA that signed the server's certificate

    def entry(self) -> dict[str, str]:
        return {k: v for k, v in asdict(self).items() if k != "name" and v is not None}


def contexts_path(env: Mapping[str, str] | None = None) -> Path:
    env = os.environ if env is None else env
    return Path(env.get(CONTEXTS_ENV) or Path.home() / ".config" / "fleetline" / "contexts.yaml")


def read_contexts(path: Path) -> tuple[str | None, dict[str, Context]]:
    """The current context's name and every context in the file (none when it is missing)."""
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except FileNotFoundError:
        return None, {}
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"contexts file {path}: {exc}") from None
    if not isinstance(data, Mapping):
        raise ConfigError(f"contexts file {path}: must be a mapping")
    contexts = {}
    for name, entry in (data.get("contexts") or {}).items():
        try:
            contexts[name] = Context(
                name, str(entry["server"]), str(entry["token"]), entry.get("ca")
            )
        except (KeyError, TypeError):
            raise ConfigError(
                f"contexts file {path}: context {name!r} needs server and token"
            ) from None
    return data.get("current"), contexts


def write_contexts(path: Path, current: str | None, contexts: Mapping[str, Context]) -> None:
    """Replace the file, owner-only (it holds credentials), in one rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = yaml.safe_dump(
        {"current": current, "contexts": {n: c.entry() for n, c in sorted(contexts.items())}},
        sort_keys=False,
    )
    partial = path.with_name(path.name + ".partial")
    descriptor = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w") as handle:
        handle.write(text)
    partial.replace(path)


def current_context(env: Mapping[str, str] | None = None) -> Context:
    """The context this command acts in: FLEETLINE_SERVER + FLEETLINE_TOKEN, else the one
    FLEETLINE_CONTEXT names, else the file's current one."""
    env = os.environ if env is None else env
    if env.get("FLEETLINE_SERVER"):
        if not env.get("FLEETLINE_TOKEN"):
            raise ConfigError("FLEETLINE_SERVER is set without FLEETLINE_TOKEN")
        return Context(
            "env", env["FLEETLINE_SERVER"], env["FLEETLINE_TOKEN"], env.get("FLEETLINE_CA")
        )
    path = contexts_path(env)
    current, contexts = read_contexts(path)
    name = env.get("FLEETLINE_CONTEXT") or current
    if name is None:
        raise ConfigError(
            "not signed in to a fleetline server: `fleetline login --server URL --token TOKEN` "
            "(writes do go through the API, with your identity)"
        )
    if name not in contexts:
        raise ConfigError(f"no context {name!r} in {path}; known: {sorted(contexts) or 'none'}")
    return contexts[name]


class Api:
    """Calls to one server with one context's credentials; refusals become the errors the
    CLI turns into one line and an exit code (401/403: 77, unreachable: 69)."""

    def __init__(self, context: Context, timeout_s: float = 30.0) -> None:
        self.context = context
        self.timeout_s = timeout_s
        server = urllib.parse.urlsplit(context.server)
        if server.scheme not in {"http", "https"} or not server.netloc:
            raise ConfigError(f"server {context.server!r} is not an http(s)://HOST:PORT address")
        self._tls = (
            ssl.create_default_context(cafile=context.ca) if server.scheme == "https" else None
        )

    def call(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        text: str | None = None,
        params: Mapping[str, Any] | None = None,
        headers: Mapping[str, str] | None = None,
        timeout_s: float | None = None,
    ) -> Any:
        """The JSON answer of `method path` (`body` sent as JSON, or `text` as YAML)."""
        query = {k: v for k, v in (params or {}).items() if v is not None}
        url = (
            self.context.server.rstrip("/")
            + path
            + (f"?{urllib.parse.urlencode(query)}" if query else "")
        )
        sent = {"Authorization": f"Bearer {self.context.token}", **(headers or {})}
        data = None
        if text is not None:
            data, sent["Content-Type"] = text.encode(), "application/yaml"
        elif body is not None:
            data, sent["Content-Type"] = json.dumps(body, default=str).encode(), "application/json"
        request = urllib.request.Request(url, data=data, method=method, headers=sent)
        try:
            with urllib.request.urlopen(
                request, timeout=timeout_s or self.timeout_s, context=self._tls
            ) as response:
                return json.loads(response.read() or b"null")
        except urllib.error.HTTPError as exc:
            raise self._refusal(exc.code, exc.read()) from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise ServiceUnavailable(
                f"the fleetline API at {self.context.server} does not answer ({reason}); "
                "`fleetline login --server URL` names another"
            ) from None

    def _refusal(self, status: int, raw: bytes) -> FleetlineError:
        try:
            detail = json.loads(raw).get("detail", raw.decode(errors="replace"))
        except (ValueError, AttributeError):
            detail = raw.decode(errors="replace")[:300]
        if isinstance(detail, list):  # a spec's bad fields, each named
            detail = "; ".join(
                f"{d.get('path') or '.'.join(map(str, d.get('loc', [])))}: "
                f"{d.get('message') or d.get('msg')}"
                for d in detail
            )
        server = self.context.server
        if status == 401:
            return AuthenticationError(
                f"{server} refused the credentials of context {self.context.name!r}: {detail} "
                "(`fleetline login` again)"
            )
        if status == 403:
            return PermissionDenied(f"{server} refused: {detail}")
        if status in (400, 404, 409, 413, 422):
            return ConfigError(str(detail))
        return FleetlineError(f"{server} answered {status}: {detail}")


def api() -> Api:
    """The API of the current context."""
    return Api(current_context())
