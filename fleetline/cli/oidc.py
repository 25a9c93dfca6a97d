"""`fleetline login --oidc`: sign in through the deployment's identity provider as a native
application does (RFC 8252): authorization code + PKCE with a one-shot HTTP listener on a
loopback port as the redirect, the browser doing the sign-in (password, second factor) at the
provider. The id token it returns is the context's bearer token; it expires with the
provider's session, and `fleetline login --oidc` again signs in anew.
"""

from __future__ import annotations

import base64
import hashlib
import json
import secrets
import ssl
import threading
import urllib.error
import urllib.parse
import urllib.request
import webbrowser
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any

from fleetline.errors import AuthenticationError, ConfigError, ServiceUnavailable


def _get(url: str, tls: ssl.SSLContext | None, data: bytes | None = None) -> Any:
    request = urllib.request.Request(url, data=data)
    if data is not None:
        request.add_header("Content-Type", "application/x-www-form-urlencoded")
    try:
        with urllib.request.urlopen(request, timeout=30, context=tls) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        try:
            body = json.loads(exc.read())
            detail = body.get("error_description") or body.get("error") or body
        except ValueError:
            detail = exc.reason
        raise AuthenticationError(f"{url} refused: {detail}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise ServiceUnavailable(f"{url} does not answer ({getattr(exc, 'reason', exc)})") from None


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


class _Answer:
    """The provider's redirect back to the loopback listener: its query, once."""

    def __init__(self) -> None:
        self.query: dict[str, str] = {}
        self.arrived = threading.Event()


def _listener(answer: _Answer) -> HTTPServer:
    class Callback(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            url = urllib.parse.urlsplit(self.path)
            if url.path != "/callback":
                self.send_error(404)
                return
            answer.query = dict(urllib.parse.parse_qsl(url.query))
            answer.arrived.set()
            self.send_response(200)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.end_headers()
            done = "failed" if "error" in answer.query else "done"
            self.wfile.write(
                f"<!doctype html><title>fleetline</title><p id='result'>Sign-in {done}; "
                "you may close this window.</p>".encode()
            )

        def log_message(self, format: str, *args: Any) -> None:
            pass  # the code must not reach a log

    return HTTPServer(("127.0.0.1", 0), Callback)


def sign_in(server: str, ca: str | None, timeout_s: float = 300.0) -> str:
    """The id token of a sign-in at the provider `server` names (GET /v1/sign-in), through the
    user's browser; raises with the provider's reason when it refuses."""
    tls = ssl.create_default_context(cafile=ca) if server.startswith("https:") else None
    config = _get(f"{server.rstrip('/')}/v1/sign-in", tls)
    if not config.get("issuer") or not config.get("cli_client"):
        raise ConfigError(
            f"{server} names no identity provider with a CLI client (jwt.cli_client in its "
            "auth config); sign in with --token"
        )
    issuer = str(config["issuer"]).rstrip("/")
    # The provider's certificate is the provider's: the system's CAs (and the context's).
    provider_tls = ssl.create_default_context(cafile=ca) if issuer.startswith("https:") else None
    metadata = _get(f"{issuer}/.well-known/openid-configuration", provider_tls)
    verifier = _b64(secrets.token_bytes(32))
    state = _b64(secrets.token_bytes(16))
    answer = _Answer()
    listener = _listener(answer)
    redirect = f"http://127.0.0.1:{listener.server_address[1]}/callback"
    serving = threading.Thread(target=listener.serve_forever, daemon=True)
    serving.start()
    try:
        url = (
            metadata["authorization_endpoint"]
            + "?"
            + urllib.parse.urlencode(
                {
                    "response_type": "code",
                    "client_id": config["cli_client"],
                    "redirect_uri": redirect,
                    "scope": config.get("scope", "openid"),
                    "state": state,
                    "code_challenge": _b64(hashlib.sha256(verifier.encode()).digest()),
                    "code_challenge_method": "S256",
                }
            )
        )
        print(f"Sign in at the identity provider in your browser:\n  {url}", flush=True)
        webbrowser.open(url)
        if not answer.arrived.wait(timeout_s):
            raise AuthenticationError(f"no sign-in came back within {timeout_s:.0f}s")
    finally:
        listener.shutdown()
        listener.server_close()
    query = answer.query
    if "error" in query:
        raise AuthenticationError(
            f"the identity provider refused: {query.get('error_description') or query['error']}"
        )
    if not secrets.compare_digest(query.get("state", ""), state):
        raise AuthenticationError("the sign-in answer is not for this sign-in (state differs)")
    tokens = _get(
        metadata["token_endpoint"],
        provider_tls,
        urllib.parse.urlencode(
            {
                "grant_type": "authorization_code",
                "code": query.get("code", ""),
                "redirect_uri": redirect,
                "client_id": config["cli_client"],
                "code_verifier": verifier,
            }
        ).encode(),
    )
    if not tokens.get("id_token"):
        raise AuthenticationError("the identity provider returned no id token")
    return str(tokens["id_token"])
