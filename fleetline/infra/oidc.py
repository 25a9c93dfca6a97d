"""A real OpenID provider on loopback for sign-in tests and the lab: node-oidc-provider (a
certified OpenID Connect implementation, npm, pinned by oidc_provider/package-lock.json) with a
login page that asks for a password and an optional one-time code (`provider.mjs`).

Its signing keys are ours to roll over as an enterprise IdP does: `publish_next_key()` (the
new key published, the old one still signing), `sign_with_next_key()`, then `retire()` (the
signing key alone), each a restart of the provider.
"""

from __future__ import annotations

import json
import secrets
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jwt
from cryptography.hazmat.primitives.asymmetric import rsa

from fleetline.errors import ServiceError
from fleetline.infra.process import ServiceProcess, run_checked

PROVIDER_DIR = Path(__file__).parent / "oidc_provider"
CONSOLE_CLIENT = "fleetline"
CLI_CLIENT = "fleetline-cli"


@dataclass(frozen=True)
class IdentityUser:
    password: str
    role: str
    tenant: str | None = None
    otp: str | None = None  # the one-time code that proves the second factor, if the user has one


def signing_key() -> dict[str, Any]:
    """A new RSA signing key as a private JWK with a random `kid`."""
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    jwk: dict[str, Any] = json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(key))
    return {**jwk, "kid": secrets.token_hex(8), "use": "sig", "alg": "RS256"}


def node_modules() -> Path:
    """The provider's npm dependencies, installed from its lock file once."""
    installed = PROVIDER_DIR / "node_modules" / ".installed"
    if not installed.exists():
        if shutil.which("npm") is None:
            raise ServiceError("npm is not on PATH; it is needed once to install oidc-provider")
        run_checked(
            ["npm", "ci", "--no-audit", "--no-fund", "--loglevel=error"],
            what="installing oidc-provider",
            cwd=PROVIDER_DIR,
        )
        installed.touch()
    return installed.parent


@dataclass
class IdentityProvider:
    run_dir: Path
    port: int
    users: Mapping[str, IdentityUser]
    console_redirects: Sequence[str] = ()  # the console's sign-in pages (…/ui/)
    host: str = "127.0.0.1"
    keys: list[dict[str, Any]] = field(default_factory=lambda: [signing_key()])

    @property
    def issuer(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def process(self) -> ServiceProcess:
        return ServiceProcess("oidc-provider", self.run_dir, self.host, self.port)

    def config(self) -> dict[str, Any]:
        return {
            "issuer": self.issuer,
            "host": self.host,
            "port": self.port,
            "jwks": {"keys": self.keys},
            "cookie_keys": [secrets.token_hex(16)],
            "clients": [
                {
                    "client_id": CONSOLE_CLIENT,
                    "token_endpoint_auth_method": "none",
                    "redirect_uris": list(self.console_redirects),
                    "grant_types": ["authorization_code"],
                    "response_types": ["code"],
                },
                {
                    # A native application (RFC 8252): a loopback redirect on any port.
                    "client_id": CLI_CLIENT,
                    "application_type": "native",
                    "token_endpoint_auth_method": "none",
                    "redirect_uris": ["http://127.0.0.1/callback"],
                    "grant_types": ["authorization_code"],
                    "response_types": ["code"],
                },
            ],
            "users": {
                name: {k: v for k, v in vars(user).items() if v is not None}
                for name, user in self.users.items()
            },
        }

    def start(self, timeout_s: float = 60.0) -> float:
        node_modules()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        config_file = self.run_dir / "provider.json"
        # The file holds private keys and passwords: the owner's alone.
        config_file.touch(mode=0o600)
        config_file.chmod(0o600)
        config_file.write_text(json.dumps(self.config()))
        if shutil.which("node") is None:
            raise ServiceError("node is not on PATH; the identity provider runs on Node.js")
        return self.process.start(
            ["node", str(PROVIDER_DIR / "provider.mjs"), str(config_file)], timeout_s=timeout_s
        )

    def stop(self) -> bool:
        return self.process.stop(timeout_s=10.0)

    def publish_next_key(self) -> str:
        """Restart publishing a new key beside the signing one, which still signs (a rollover's
        first step: relying parties learn the key before any token names it); its kid."""
        self.keys = [*self.keys, signing_key()]
        self._restart()
        return str(self.keys[-1]["kid"])

    def sign_with_next_key(self) -> None:
        """Restart signing with the key published last, the others still published."""
        self.keys = [self.keys[-1], *self.keys[:-1]]
        self._restart()

    def retire(self) -> None:
        """Restart publishing the signing key alone: tokens signed by older keys stop verifying."""
        self.keys = self.keys[:1]
        self._restart()

    def _restart(self) -> None:
        self.stop()
        self.start()

    def wipe(self) -> None:
        self.stop()
        shutil.rmtree(self.run_dir, ignore_errors=True)
