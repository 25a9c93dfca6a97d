"""The HTTP API over TLS, as `fleetline serve --tls-cert --tls-key` runs it (uvicorn)."""

from __future__ import annotations

import datetime
import json
import socket
import ssl
import threading
import urllib.error
import urllib.request

import pytest
import uvicorn
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from fleetline.api.app import create_app
from fleetline.api.auth import AuthConfig, Authenticator, token_digest
from fleetline.processors.view.read import StaticView
from tests.fleet_events import fold, scenario_events
from tests.support import Recorder, wait_until


def self_signed(tmp_path):
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    import ipaddress

    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_api_serves_https_and_refuses_plain_http(tmp_path):
    cert, key = self_signed(tmp_path)
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
            ssl_certfile=str(cert),
            ssl_keyfile=str(key),
        )
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_until(lambda: server.started, 20, what="the TLS server")
        context = ssl.create_default_context(cafile=str(cert))
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
