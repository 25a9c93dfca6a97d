"""The HTTP API over TLS, as `fleetline serve --tls-cert --tls-key` runs it (uvicorn)."""

from __future__ import annotations

import json
import socket
import ssl
import threading
import urllib.error
import urllib.request

import pytest
import uvicorn

from fleetline.api.app import create_app
from fleetline.api.auth import AuthConfig, Authenticator, token_digest
from fleetline.infra import ca
from fleetline.processors.view.read import StaticView
from tests.fleet_events import fold, scenario_events
from tests.support import Recorder, wait_until


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_api_serves_https_and_refuses_plain_http(tmp_path):
    ca.init(tmp_path)
    issued = ca.issue(tmp_path, "api", ["127.0.0.1"])
    auth = Authenticator(
        AuthConfig.from_data(
            {
                "tokens": [
                    {
                        "name": "v",
                        "sha256": token_digest("fl_v"),
                        "role": "viewer",
                        "tenant": "acme",
                    }
                ]
            }
        )
    )
    app = create_app(StaticView(fold(scenario_events(seconds=2))), auth, Recorder())
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host="127.0.0.1",
            port=port,
            log_level="error",
            ssl_certfile=str(issued.cert),
            ssl_keyfile=str(issued.key),
        )
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_until(lambda: server.started, 20, what="the TLS server")
        context = ssl.create_default_context(cafile=str(issued.ca))
        request = urllib.request.Request(
            f"https://127.0.0.1:{port}/v1/clusters", headers={"Authorization": "Bearer fl_v"}
        )
        with urllib.request.urlopen(request, context=context, timeout=10) as response:
            assert response.status == 200
            assert len(json.loads(response.read())["items"]) == 3
        with pytest.raises((urllib.error.URLError, ConnectionError)):
            urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/clusters", timeout=5)
        with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
            urllib.request.urlopen(
                f"https://127.0.0.1:{port}/v1/clusters",
                context=ssl.create_default_context(),
                timeout=5,
            )
    finally:
        server.should_exit = True
        thread.join(10)
