"""The Kubernetes API over HTTPS, as a kubeconfig reaches it: JSON in and out, and watches.

Both the cluster agent's Kubernetes backend and `fleetline infra start --kubernetes` use it; it
needs nothing but the standard library. A kubeconfig's current context gives the server, its CA
and the client's credentials: a certificate and key (as files or as `-data` fields) or a bearer
token. Every answer the API server refuses is raised in its own words (`KubeError`, with the
HTTP status), so an agent reports "401 Unauthorized" as the server said it.
"""

from __future__ import annotations

import base64
import json
import ssl
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import yaml

from fleetline.errors import ServiceError


class KubeError(ServiceError):
    """The API server refused a call or could not be reached; `status` 0 when unreachable."""

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


def _material(entry: Mapping[str, Any], field: str, base: Path) -> str | None:
    """A kubeconfig credential as a file path: the field's file, or its `-data` (base64)
    written to a private temporary file (ssl loads certificates from files only)."""
    if entry.get(f"{field}-data"):
        data = base64.b64decode(entry[f"{field}-data"])
        with tempfile.NamedTemporaryFile("wb", prefix="fleetline-kube-", delete=False) as out:
            out.write(data)
        return out.name
    if entry.get(field):
        return str(base / str(entry[field]))
    return None


class KubeApi:
    """One API server, with the credentials a kubeconfig gives."""

    def __init__(self, server: str, context: ssl.SSLContext, token: str | None = None) -> None:
        self.server = server.rstrip("/")
        self.context = context
        self.token = token

    @classmethod
    def from_kubeconfig(cls, path: Path) -> KubeApi:
        try:
            document = yaml.safe_load(path.read_text())
        except OSError as exc:
            raise KubeError(f"no kubeconfig at {path}: {exc.strerror}") from exc
        except yaml.YAMLError as exc:
            raise KubeError(f"{path}: not YAML: {exc}") from exc
        try:
            contexts = {c["name"]: c["context"] for c in document.get("contexts") or ()}
            current = contexts[document.get("current-context") or next(iter(contexts))]
            cluster = {c["name"]: c["cluster"] for c in document["clusters"]}[current["cluster"]]
            users = {u["name"]: u.get("user") or {} for u in document.get("users") or ()}
            user = users.get(current.get("user", ""), {})
            server = str(cluster["server"])
        except (AttributeError, KeyError, StopIteration, TypeError) as exc:
            raise KubeError(f"{path}: no usable context, cluster and server ({exc!r})") from exc
        base = path.parent
        try:
            context = ssl.create_default_context(
                cafile=_material(cluster, "certificate-authority", base)
            )
            certificate = _material(user, "client-certificate", base)
            if certificate is not None:
                context.load_cert_chain(certificate, _material(user, "client-key", base))
        except (ssl.SSLError, OSError, ValueError) as exc:
            raise KubeError(f"{path}: its certificates cannot be loaded: {exc}") from exc
        return cls(server, context, user.get("token"))

    def _request(
        self, method: str, path: str, body: Any, content_type: str
    ) -> urllib.request.Request:
        headers = {"Content-Type": content_type, "Accept": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        return urllib.request.Request(
            self.server + path,
            method=method,
            data=None if body is None else json.dumps(body).encode(),
            headers=headers,
        )

    def call(
        self,
        method: str,
        path: str,
        body: Any = None,
        content_type: str = "application/json",
        timeout_s: float = 10.0,
    ) -> tuple[int, Any]:
        """(HTTP status, the answer's JSON) for any status; raises only when unreachable."""
        request = self._request(method, path, body, content_type)
        try:
            with urllib.request.urlopen(request, context=self.context, timeout=timeout_s) as r:
                return r.status, json.loads(r.read() or b"null")
        except urllib.error.HTTPError as exc:
            try:
                return exc.code, json.loads(exc.read() or b"null")
            except ValueError:
                return exc.code, {"message": exc.reason}
        except (urllib.error.URLError, OSError, ValueError) as exc:
            raise KubeError(f"the Kubernetes API at {self.server} does not answer: {exc}") from exc

    def ok(self, method: str, path: str, body: Any = None, **kwargs: Any) -> Any:
        """The answer of a call that must succeed; else KubeError in the server's words."""
        status, answer = self.call(method, path, body, **kwargs)
        if status >= 300:
            raise KubeError(f"{method} {path.split('?')[0]}: {refusal(status, answer)}", status)
        return answer

    def get(self, path: str) -> Any:
        status, body = self.call("GET", path)
        return body if status == 200 else None

    def ensure(self, collection: str, name: str, body: Any) -> None:
        """Create the object unless it exists."""
        status, answer = self.call("POST", collection, body)
        if status not in (200, 201, 409):
            raise KubeError(f"creating {name}: {refusal(status, answer)}", status)

    def watch(
        self, collection: str, query: Mapping[str, str], resource_version: str, timeout_s: int
    ) -> Iterator[dict[str, Any]]:
        """The collection's events after `resource_version`, one at a time, until the server
        ends the watch (after `timeout_s`); a refused watch raises (410: start again from a
        fresh list)."""
        params = urllib.parse.urlencode(
            {
                **query,
                "watch": "true",
                "resourceVersion": resource_version,
                "timeoutSeconds": str(timeout_s),
            }
        )
        request = self._request("GET", f"{collection}?{params}", None, "application/json")
        try:
            with urllib.request.urlopen(
                request, context=self.context, timeout=timeout_s + 10
            ) as stream:
                for line in stream:
                    if not line.strip():
                        continue
                    event = json.loads(line)
                    if event.get("type") == "ERROR":
                        status = event.get("object") or {}
                        raise KubeError(
                            f"watch {collection}: {refusal(int(status.get('code') or 0), status)}",
                            int(status.get("code") or 0),
                        )
                    yield event
        except urllib.error.HTTPError as exc:
            raise KubeError(f"watch {collection}: {exc.code} {exc.reason}", exc.code) from exc
        except (urllib.error.URLError, OSError, ValueError) as exc:
            raise KubeError(f"the Kubernetes API at {self.server} does not answer: {exc}") from exc


def refusal(status: int, answer: Any) -> str:
    """The server's own words for a refused call: "403 Forbidden: pods is forbidden: ..."."""
    words = answer.get("message") if isinstance(answer, dict) else None
    reason = answer.get("reason") if isinstance(answer, dict) else None
    return f"{status} {reason or ''}".strip() + (f": {words}" if words else "")
