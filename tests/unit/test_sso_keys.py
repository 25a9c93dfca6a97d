"""SSO keys from the identity provider (OIDC discovery, then its JWKS): read when first needed,
again on a schedule and when a token names a key not seen yet, so keys rotate without a
restart, and a key the provider dropped stops verifying."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import jwt
import pytest
from cryptography.hazmat.primitives.asymmetric import rsa

from fleetline.api.auth import AuthConfig, Authenticator, ProviderKeys
from fleetline.errors import AuthenticationError, ConfigError

OLD = rsa.generate_private_key(public_exponent=65537, key_size=2048)
NEW = rsa.generate_private_key(public_exponent=65537, key_size=2048)


def published(*keys: tuple[str, rsa.RSAPrivateKey]) -> dict:
    out = []
    for kid, key in keys:
        public = json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(key.public_key()))
        out.append({**public, "kid": kid, "use": "sig", "alg": "RS256"})
    return {"keys": out}


class Provider:
    """An identity provider's two documents, served on loopback; `keys` may be replaced."""

    def __init__(self) -> None:
        self.keys = published(("k1", OLD))
        self.reads = 0
        provider = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path == "/.well-known/openid-configuration":
                    body = {"issuer": provider.issuer, "jwks_uri": f"{provider.issuer}/keys"}
                elif self.path == "/keys":
                    provider.reads += 1
                    body = provider.keys
                else:
                    self.send_error(404)
                    return
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.issuer = f"http://127.0.0.1:{self.server.server_address[1]}"


@pytest.fixture
def provider() -> Iterator[Provider]:
    idp = Provider()
    thread = threading.Thread(target=idp.server.serve_forever, daemon=True)
    thread.start()
    yield idp
    idp.server.shutdown()
    idp.server.server_close()


def token(issuer: str, kid: str, key: rsa.RSAPrivateKey, audience: str = "fleetline") -> str:
    now = int(time.time())
    claims = {"iss": issuer, "aud": audience, "sub": "alice", "exp": now + 300,
              "fleetline_role": "user", "tenant": "acme"}  # fmt: skip
    return "Bearer " + jwt.encode(claims, key, algorithm="RS256", headers={"kid": kid})


def test_keys_rotate_at_the_provider_without_a_restart(provider):
    config = AuthConfig.from_data(
        {"jwt": {"issuer": provider.issuer, "audience": "fleetline", "discovery": True}}
    )
    assert provider.reads == 0  # nothing is fetched until a token needs it
    now = [0.0]
    assert config.jwt is not None and isinstance(config.jwt.keys, ProviderKeys)
    config.jwt.keys.clock = lambda: now[0]
    auth = Authenticator(config)
    assert auth.authenticate(token(provider.issuer, "k1", OLD)).subject == "alice"
    assert auth.authenticate(token(provider.issuer, "k1", OLD)).subject == "alice"
    assert provider.reads == 1  # cached
    # The provider rotates: k2 is published, k1 withdrawn. A token under k2 makes us read the
    # keys again (once 10 s have passed since the last read; a made-up kid cannot make us
    # hammer the provider).
    provider.keys = published(("k2", NEW))
    with pytest.raises(AuthenticationError, match="no signing key"):
        auth.authenticate(token(provider.issuer, "k2", NEW))  # read 1 s ago: not again yet
    now[0] = 11.0
    assert auth.authenticate(token(provider.issuer, "k2", NEW)).subject == "alice"
    assert provider.reads == 2
    for _ in range(5):
        with pytest.raises(AuthenticationError, match="no signing key"):
            auth.authenticate(token(provider.issuer, "k9", NEW))
    assert provider.reads == 2
    # The withdrawn key stops verifying once the keys are read again.
    with pytest.raises(AuthenticationError, match="no signing key"):
        auth.authenticate(token(provider.issuer, "k1", OLD))
    # A key forged under a published id does not verify.
    with pytest.raises(AuthenticationError, match="signature does not verify"):
        auth.authenticate(token(provider.issuer, "k2", OLD))


def test_an_unreachable_provider_or_one_naming_another_issuer_is_a_refusal_not_a_crash(provider):
    gone = AuthConfig.from_data(
        {"jwt": {"issuer": "http://127.0.0.1:1", "audience": "fleetline", "discovery": True}}
    )
    with pytest.raises(AuthenticationError, match=r"keys could not be read from http://127\.0"):
        Authenticator(gone).authenticate(token("http://127.0.0.1:1", "k1", OLD))
    wrong = AuthConfig.from_data(
        {
            "jwt": {
                "issuer": provider.issuer + "/other",
                "audience": "fleetline",
                "jwks_uri": provider.issuer + "/nowhere",
            }
        }
    )
    with pytest.raises(AuthenticationError, match="could not be read"):
        Authenticator(wrong).authenticate(token(provider.issuer, "k1", OLD))
    with pytest.raises(ConfigError, match="name the keys"):
        AuthConfig.from_data({"jwt": {"issuer": provider.issuer, "audience": "fleetline"}})


def test_the_accepted_audiences_and_the_sign_in_document(provider):
    config = AuthConfig.from_data(
        {
            "jwt": {
                "issuer": provider.issuer,
                "discovery": True,
                "audience": ["fleetline", "fleetline-cli"],
                "console_client": "fleetline",
                "cli_client": "fleetline-cli",
            }
        }
    )
    assert config.jwt is not None and config.jwt.sign_in() == {
        "issuer": provider.issuer,
        "console_client": "fleetline",
        "cli_client": "fleetline-cli",
        "scope": "openid fleetline",
    }
    for audience in ("fleetline", "fleetline-cli"):
        signed = token(provider.issuer, "k1", OLD, audience=audience)
        assert Authenticator(config).authenticate(signed).subject == "alice"
    with pytest.raises(AuthenticationError, match="another audience"):
        Authenticator(config).authenticate(token(provider.issuer, "k1", OLD, audience="other"))
    for bad in ([], "", [3]):
        with pytest.raises(ConfigError, match="audience must be a client id"):
            AuthConfig.from_data(
                {"jwt": {"issuer": provider.issuer, "discovery": True, "audience": bad}}
            )
