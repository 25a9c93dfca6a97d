"""TLS between fleetline's own HTTP processes (the router and the inference replicas), with the
deployment's CA: who a peer is, and what this process shows.

Every process on a host that takes part is given three files (`fleetline infra ca` makes them
for a lab or a test; a production deployment issues them from its own CA):

    FLEETLINE_TLS_CA     the deployment's CA certificate: the only issuer this process trusts
    FLEETLINE_TLS_CERT   this process's certificate, issued by that CA; its common name is the
                         process's identity ("router", a cluster's name) and its subject names
                         the addresses it is reached at
    FLEETLINE_TLS_KEY    the certificate's private key

Unset, everything speaks plain HTTP as before (one host, loopback). Set, a replica listens for
TLS only and asks every caller for a certificate from the same CA (mutual TLS), the router and
the cluster agent present theirs, and each side checks that the other's certificate names the
address it dialled.
"""

from __future__ import annotations

import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fleetline.errors import ConfigError

if TYPE_CHECKING:
    from cryptography import x509

ENV = ("FLEETLINE_TLS_CA", "FLEETLINE_TLS_CERT", "FLEETLINE_TLS_KEY")
# The identity a replica serves inference to: the router's certificate's common name.
ROUTER_IDENTITY = "router"


@dataclass(frozen=True)
class TlsSettings:
    ca: Path
    cert: Path
    key: Path
    router_identity: str = ROUTER_IDENTITY

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> TlsSettings | None:
        """The three files, or None when none is set; some but not all is an error."""
        given = {name: env.get(name, "").strip() for name in ENV}
        if not any(given.values()):
            return None
        missing = [name for name, value in given.items() if not value]
        if missing:
            raise ConfigError(
                f"TLS needs {', '.join(ENV)} together; {', '.join(missing)} unset "
                "(`fleetline infra ca issue` prints all three)"
            )
        settings = cls(
            Path(given["FLEETLINE_TLS_CA"]),
            Path(given["FLEETLINE_TLS_CERT"]),
            Path(given["FLEETLINE_TLS_KEY"]),
            env.get("FLEETLINE_TLS_ROUTER_IDENTITY", "").strip() or ROUTER_IDENTITY,
        )
        for name, path in zip(ENV, (settings.ca, settings.cert, settings.key), strict=True):
            if not path.is_file():
                raise ConfigError(f"{name}: {path} is not a file")
        return settings

    def as_env(self) -> dict[str, str]:
        """The variables `from_env` reads back (for a child process on the same host)."""
        return {
            "FLEETLINE_TLS_CA": str(self.ca),
            "FLEETLINE_TLS_CERT": str(self.cert),
            "FLEETLINE_TLS_KEY": str(self.key),
            "FLEETLINE_TLS_ROUTER_IDENTITY": self.router_identity,
        }

    def identity(self) -> str:
        """This process's identity: its certificate's common name."""
        from cryptography import x509

        try:
            certificate = x509.load_pem_x509_certificate(self.cert.read_bytes())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"FLEETLINE_TLS_CERT {self.cert}: {exc}") from None
        return common_name(certificate.subject) or ""

    def server_context(self, verify_clients: bool) -> ssl.SSLContext:
        """For a listener: its own certificate; with `verify_clients`, only callers holding a
        certificate from the deployment's CA get past the handshake."""
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(self.ca))
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        self._load_own(context)
        context.verify_mode = ssl.CERT_REQUIRED if verify_clients else ssl.CERT_NONE
        return context

    def client_context(self) -> ssl.SSLContext:
        """For a caller: trusts the deployment's CA only, checks the name it dialled against the
        server's certificate, and shows its own certificate when asked."""
        context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(self.ca))
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        self._load_own(context)
        return context

    def _load_own(self, context: ssl.SSLContext) -> None:
        try:
            context.load_cert_chain(str(self.cert), str(self.key))
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(
                f"FLEETLINE_TLS_CERT/KEY {self.cert}, {self.key}: {exc} "
                "(a certificate and the key it was issued for, PEM)"
            ) from None


def common_name(name: x509.Name) -> str | None:
    from cryptography.x509.oid import NameOID

    found = name.get_attributes_for_oid(NameOID.COMMON_NAME)
    value = found[0].value if found else None
    return value if isinstance(value, str) else None


def peer_identity(peercert: Mapping[str, Any] | None) -> str | None:
    """The common name in a verified peer certificate as `SSLSocket.getpeercert()` gives it
    (None when the peer showed none)."""
    if not peercert:
        return None
    for rdn in peercert.get("subject", ()):
        for key, value in rdn:
            if key == "commonName":
                return str(value)
    return None


def scheme(tls: TlsSettings | None) -> str:
    return "https" if tls is not None else "http"


def subject_name(host: str) -> x509.GeneralName:
    """How a certificate names `host` among its subject alternative names: an IP address as
    one, anything else as a DNS name."""
    import ipaddress

    from cryptography import x509

    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def pinned_identity(host: str, days: int = 30) -> tuple[ssl.SSLContext, str]:
    """A server context with a fresh self-signed certificate for `host`, and that certificate's
    PEM, for a service whose callers learn the certificate from somewhere they already trust
    (an owner-only file beside the token): they pin it, so no CA is involved. The key never
    leaves memory but for the moment `load_cert_chain` needs it in a file (owner-only, deleted)."""
    import datetime
    import os
    import tempfile

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host)])
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName([subject_name(host)]), critical=False)
        .sign(key, hashes.SHA256())
    )
    pem = certificate.public_bytes(serialization.Encoding.PEM).decode()
    secret = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    descriptor, path = tempfile.mkstemp(suffix=".pem")  # mkstemp creates it 0600
    try:
        with os.fdopen(descriptor, "wb") as handle:
            handle.write(pem.encode() + secret)
        context.load_cert_chain(path)
    finally:
        os.unlink(path)
    return context, pem


def pinned_client(pem: str) -> ssl.SSLContext:
    """A client context that trusts the one certificate `pem` (see `pinned_identity`)."""
    context = ssl.create_default_context(cadata=pem)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    return context
