"""Authentication: API tokens and OIDC-style JWT bearer tokens.

The config file (YAML, `FLEETLINE_AUTH_CONFIG`):

    tokens:                       # service credentials; only their SHA-256 is stored
      - {name: ci-bot, sha256: <hex of sha256(token)>, role: user, tenant: acme,
         expires: 2027-03-01T00:00:00Z}   # optional: refused from then on
    jwt:
      issuer: https://sso.example.com
      # Where the signing keys come from (one of):
      discovery: true             # OIDC discovery: {issuer}/.well-known/openid-configuration
      # jwks_uri: https://sso.example.com/keys
      # jwks_file: sso-keys.json  # a JWKS document kept beside this file (no rotation)
      refresh_s: 300              # keys are read again this often; a token naming a key not
                                  # seen yet reads them at once (at most every 10 s)
      ca: /etc/fleetline/idp-ca.pem   # optional: the CA of the provider's certificate
      audience: fleetline         # or a list: the clients whose id tokens are accepted
      console_client: fleetline   # optional: the console signs in with this public client
      cli_client: fleetline-cli   # optional: `fleetline login --oidc` signs in with this one
      role_claim: fleetline_role  # default
      tenant_claim: tenant        # default
      algorithms: [RS256, ES256, EdDSA]
    require_mfa: [platform-admin, tenant-admin]   # these roles need `amr` to contain "mfa"

A JWT's signature (by the JWKS key its `kid` names), expiry, issuer and audience are checked;
a role listed in `require_mfa` also needs the second-factor claim, so an SSO provider's MFA is
what admits the admin roles. API tokens are automation's credentials: they carry no second
factor, so a token whose role is in `require_mfa` is refused (automation gets narrower roles),
and a token past its `expires` is refused.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import re
import ssl
import threading
import time
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

import jwt
import yaml

from fleetline.api.rbac import ROLES, SERVICES_INFER, Principal, Rule, authorize
from fleetline.errors import AuthenticationError, ConfigError

_CREDENTIAL = re.compile(r"(?i)(bearer\s+)[A-Za-z0-9._~+/=-]+|\bfl_[A-Za-z0-9_-]+")


class CredentialFilter(logging.Filter):
    """Masks bearer tokens and fleetline API tokens in log records, whatever logged them."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        masked = _CREDENTIAL.sub(lambda m: (m.group(1) or "") + "***", message)
        if masked != message:
            record.msg, record.args = masked, None
        return True


def token_digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class KeySet(Protocol):
    def key(self, kid: str) -> jwt.PyJWK | None:
        """The signing key `kid` names, or None when the provider has none by that id."""
        ...


@dataclass(frozen=True)
class StaticKeys:
    """A JWKS document read once (`jwks_file`): keys rotate only with a restart."""

    keys: jwt.PyJWKSet

    def key(self, kid: str) -> jwt.PyJWK | None:
        try:
            return self.keys[kid]
        except KeyError:
            return None


class ProviderKeys:
    """The identity provider's published keys (its JWKS, found through OIDC discovery or named
    by `jwks_uri`), read when first needed, again every `refresh_s`, and at once when a token
    names a key not seen yet (at most every `min_interval_s`, so made-up ids cannot make us
    hammer the provider): keys rotate without a restart, and a key the provider dropped stops
    verifying at the next refresh."""

    def __init__(
        self,
        issuer: str,
        jwks_uri: str | None = None,
        refresh_s: float = 300.0,
        min_interval_s: float = 10.0,
        ca: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.issuer = issuer.rstrip("/")
        self.jwks_uri = jwks_uri
        self.refresh_s, self.min_interval_s = refresh_s, min_interval_s
        self.clock = clock
        self._tls = ssl.create_default_context(cafile=ca) if ca else None
        self._keys: dict[str, jwt.PyJWK] = {}
        self._read_at: float | None = None
        self._lock = threading.Lock()

    def _get(self, url: str) -> Any:
        try:
            with urllib.request.urlopen(url, timeout=10, context=self._tls) as response:
                return json.loads(response.read())
        except (OSError, ValueError) as exc:
            raise AuthenticationError(
                f"the identity provider's keys could not be read from {url}: {exc}"
            ) from None

    def _read(self) -> None:
        uri = self.jwks_uri
        if uri is None:
            found = self._get(f"{self.issuer}/.well-known/openid-configuration")
            if found.get("issuer", "").rstrip("/") != self.issuer or "jwks_uri" not in found:
                raise AuthenticationError(
                    f"{self.issuer}'s discovery document names another issuer or no jwks_uri"
                )
            uri = str(found["jwks_uri"])
        keys = {}
        for entry in self._get(uri).get("keys", []):
            try:
                key = jwt.PyJWK.from_dict(entry)
            except jwt.PyJWTError:
                continue  # a key of a kind we do not verify with (e.g. encryption)
            if key.key_id:
                keys[key.key_id] = key
        self._keys, self._read_at = keys, self.clock()

    def key(self, kid: str) -> jwt.PyJWK | None:
        with self._lock:
            now = self.clock()
            age = None if self._read_at is None else now - self._read_at
            if (
                age is None
                or age >= self.refresh_s
                or (kid not in self._keys and age >= self.min_interval_s)
            ):
                self._read()
            return self._keys.get(kid)


@dataclass(frozen=True)
class JwtConfig:
    keys: KeySet
    issuer: str
    audience: tuple[str, ...]
    role_claim: str = "fleetline_role"
    tenant_claim: str = "tenant"
    algorithms: tuple[str, ...] = ("RS256", "ES256", "EdDSA")
    leeway_s: int = 30
    console_client: str | None = None
    cli_client: str | None = None

    def sign_in(self) -> dict[str, Any]:
        """What a console or CLI needs to sign in through the provider (authorization code +
        PKCE): the issuer to discover from, and the public client each uses."""
        return {
            "issuer": self.issuer,
            "console_client": self.console_client,
            "cli_client": self.cli_client,
            "scope": "openid fleetline",
        }


@dataclass(frozen=True)
class ApiToken:
    principal: Principal
    expires_s: float | None = None  # epoch seconds; None: until it is removed from the config


def _expiry(value: Any, name: Any) -> float | None:
    """A token's `expires` (ISO 8601, a YAML timestamp or epoch seconds) as epoch seconds."""
    if value is None:
        return None
    if isinstance(value, int | float):
        return float(value)
    try:
        moment = value if isinstance(value, datetime) else datetime.fromisoformat(str(value))
    except ValueError:
        raise ConfigError(f"token {name!r}: expires {value!r} is not an ISO 8601 time") from None
    return (moment if moment.tzinfo else moment.replace(tzinfo=UTC)).timestamp()


def _audiences(value: Any) -> tuple[str, ...]:
    audiences = (value,) if isinstance(value, str) else tuple(value or ())
    if not audiences or not all(isinstance(a, str) and a for a in audiences):
        raise ValueError("audience must be a client id or a list of them")
    return audiences


@dataclass(frozen=True)
class AuthConfig:
    tokens: Mapping[str, ApiToken] = field(default_factory=dict)  # sha256 hex -> token
    jwt: JwtConfig | None = None
    require_mfa: frozenset[str] = frozenset()

    @classmethod
    def from_file(cls, path: Path) -> AuthConfig:
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise ConfigError(f"auth config {path}: {exc}") from None
        return cls.from_data(data, base=path.parent)

    @classmethod
    def from_data(cls, data: Mapping[str, Any], base: Path = Path(".")) -> AuthConfig:
        tokens: dict[str, ApiToken] = {}
        for entry in data.get("tokens", []) or []:
            role = entry.get("role")
            if role not in ROLES:
                raise ConfigError(
                    f"token {entry.get('name')!r}: role {role!r} is not one of {', '.join(ROLES)}"
                )
            digest = str(entry.get("sha256", "")).lower()
            if len(digest) != 64:
                raise ConfigError(f"token {entry.get('name')!r}: sha256 must be 64 hex digits")
            tokens[digest] = ApiToken(
                Principal(entry["name"], role, entry.get("tenant"), "token"),
                _expiry(entry.get("expires"), entry.get("name")),
            )
        jwt_config = None
        if data.get("jwt"):
            j = data["jwt"]
            try:
                keys: KeySet
                if j.get("jwks_file"):
                    keys = StaticKeys(
                        jwt.PyJWKSet.from_dict(json.loads((base / j["jwks_file"]).read_text()))
                    )
                elif j.get("discovery") or j.get("jwks_uri"):
                    keys = ProviderKeys(
                        j["issuer"],
                        j.get("jwks_uri"),
                        float(j.get("refresh_s", 300)),
                        ca=str(base / j["ca"]) if j.get("ca") else None,
                    )
                else:
                    raise ConfigError(
                        "auth config jwt: name the keys: discovery: true, jwks_uri or jwks_file"
                    )
                jwt_config = JwtConfig(
                    keys=keys,
                    issuer=j["issuer"],
                    audience=_audiences(j["audience"]),
                    role_claim=j.get("role_claim", "fleetline_role"),
                    tenant_claim=j.get("tenant_claim", "tenant"),
                    algorithms=tuple(j.get("algorithms", JwtConfig.algorithms)),
                    console_client=j.get("console_client"),
                    cli_client=j.get("cli_client"),
                )
            except (KeyError, OSError, ValueError, jwt.PyJWTError) as exc:
                raise ConfigError(f"auth config jwt: {type(exc).__name__}: {exc}") from None
        mfa = frozenset(data.get("require_mfa", []) or [])
        unknown = mfa - set(ROLES)
        if unknown:
            raise ConfigError(f"require_mfa names unknown roles: {sorted(unknown)}")
        return cls(tokens=tokens, jwt=jwt_config, require_mfa=mfa)


class Authenticator:
    def __init__(self, config: AuthConfig, clock: Callable[[], float] = time.time) -> None:
        self.config = config
        self.clock = clock

    def authenticate(self, authorization: str | None) -> Principal:
        """The principal behind an `Authorization: Bearer ...` header, or AuthenticationError
        saying why not (never echoing the credential)."""
        if not authorization:
            raise AuthenticationError("no credentials: send Authorization: Bearer <token>")
        scheme, _, credential = authorization.partition(" ")
        if scheme.lower() != "bearer" or not credential.strip():
            raise AuthenticationError("the Authorization header is not a bearer token")
        credential = credential.strip()
        if credential.count(".") == 2:
            return self._jwt(credential)
        digest = token_digest(credential)
        for known, token in self.config.tokens.items():
            if hmac.compare_digest(known, digest):
                return self._admit(token)
        raise AuthenticationError("unknown API token")

    def _admit(self, token: ApiToken) -> Principal:
        principal = token.principal
        if token.expires_s is not None and self.clock() >= token.expires_s:
            when = datetime.fromtimestamp(token.expires_s, UTC).isoformat()
            raise AuthenticationError(f"API token {principal.subject} expired at {when}")
        if principal.role in self.config.require_mfa:
            raise AuthenticationError(
                f"role {principal.role} requires a second factor and an API token carries "
                "none: sign in through SSO, or give automation a narrower role"
            )
        return principal

    def _jwt(self, token: str) -> Principal:
        config = self.config.jwt
        if config is None:
            raise AuthenticationError("JWT bearer tokens are not configured")
        try:
            kid = jwt.get_unverified_header(token).get("kid")
        except jwt.PyJWTError:
            raise AuthenticationError("token is not a JWT this server can read") from None
        if not kid:
            raise AuthenticationError("token has no kid header")
        key = config.keys.key(str(kid))
        if key is None:
            raise AuthenticationError("token names no signing key this server knows")
        try:
            claims = jwt.decode(
                token,
                key=key,
                algorithms=list(config.algorithms),
                audience=list(config.audience),
                issuer=config.issuer,
                leeway=config.leeway_s,
                options={"require": ["exp", "sub", "aud", "iss"]},
            )
        except jwt.ExpiredSignatureError:
            raise AuthenticationError("token expired") from None
        except jwt.InvalidAudienceError:
            raise AuthenticationError("token is for another audience") from None
        except jwt.InvalidIssuerError:
            raise AuthenticationError("token is from another issuer") from None
        except jwt.InvalidSignatureError:
            raise AuthenticationError("token signature does not verify") from None
        except jwt.PyJWTError as exc:
            raise AuthenticationError(f"token refused: {type(exc).__name__}") from None
        role = claims.get(config.role_claim)
        if role not in ROLES:
            raise AuthenticationError(f"token's {config.role_claim} claim names no known role")
        amr = claims.get("amr") or []
        amr = tuple(amr) if isinstance(amr, list) else ()
        if role in self.config.require_mfa and "mfa" not in amr:
            raise AuthenticationError(f"role {role} requires a second factor (amr has no mfa)")
        tenant = claims.get(config.tenant_claim)
        return Principal(str(claims["sub"]), role, str(tenant) if tenant else None, "jwt", amr)


def inference_admission(authenticator: Authenticator) -> Callable[[str | None, str], None]:
    """The router's check on `POST /v1/services/TENANT/NAME/infer`: a valid token (an API
    token or a JWT, as for the API) whose role may call services, held to its tenant."""
    rule = Rule(*SERVICES_INFER)

    def admit(authorization: str | None, tenant: str) -> None:
        authorize(authenticator.authenticate(authorization), rule, tenant)

    return admit
