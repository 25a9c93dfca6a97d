"""A deployment CA for a lab or a test: `fleetline infra ca init` and `issue`.

A production deployment brings its own CA (its PKI issues each host's certificate); this one
makes the same files on one machine so that the router and the replicas can speak mutual TLS
across the lab's hosts. Keys are EC P-256 and stay on this machine, readable by root only.

    DIR/ca.pem, DIR/ca-key.pem                 the CA (init)
    DIR/IDENTITY.pem, DIR/IDENTITY-key.pem     one identity's certificate and key (issue)

An identity's certificate carries its name as the common name (what a replica checks: only
the router's may ask for inference) and every address it is reached at as a subject
alternative name (what a caller checks against the address it dialled).
"""

from __future__ import annotations

import datetime
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from fleetline.config import host_address
from fleetline.errors import ConfigError
from fleetline.tls import ROUTER_IDENTITY, TlsSettings, subject_name

IDENTITY = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")
CA_DAYS = 3650
LEAF_DAYS = 365


@dataclass(frozen=True)
class Issued:
    identity: str
    ca: Path
    cert: Path
    key: Path

    def env(self) -> dict[str, str]:
        return {
            "FLEETLINE_TLS_CA": str(self.ca),
            "FLEETLINE_TLS_CERT": str(self.cert),
            "FLEETLINE_TLS_KEY": str(self.key),
        }

    def settings(self, router_identity: str = ROUTER_IDENTITY) -> TlsSettings:
        """The TLS settings of a process holding this certificate."""
        return TlsSettings(self.ca, self.cert, self.key, router_identity)


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    data = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(data)


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def init(directory: Path, name: str = "fleetline deployment CA") -> Path:
    """A new CA in `directory` (kept when one is there: the certificates issued stay valid)."""
    cert_path, key_path = directory / "ca.pem", directory / "ca-key.pem"
    if cert_path.exists() and key_path.exists():
        return cert_path
    directory.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = _now()
    certificate = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=CA_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    _write_key(key_path, key)
    cert_path.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    return cert_path


def _subject_names(hosts: Sequence[str]) -> list[x509.GeneralName]:
    return [subject_name(host_address(host, "--host")) for host in hosts]


def issue(directory: Path, identity: str, hosts: Sequence[str]) -> Issued:
    """A certificate for `identity`, reached at `hosts` (addresses or names), from the CA in
    `directory`; issued again (a new key) when it exists."""
    if not IDENTITY.match(identity):
        raise ConfigError(
            f"identity {identity!r}: lower-case letters, digits and '-', at most 63 characters"
        )
    if not hosts:
        raise ConfigError("name at least one --host the identity is reached at")
    names = _subject_names(hosts)
    ca_cert_path, ca_key_path = directory / "ca.pem", directory / "ca-key.pem"
    try:
        ca_cert = x509.load_pem_x509_certificate(ca_cert_path.read_bytes())
        ca_key = serialization.load_pem_private_key(ca_key_path.read_bytes(), password=None)
    except FileNotFoundError:
        raise ConfigError(f"no CA in {directory}: run `fleetline infra ca init` first") from None
    except ValueError as exc:
        raise ConfigError(f"the CA in {directory} does not load: {exc}") from None
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise ConfigError(f"{ca_key_path} is not an EC key this tool made")
    key = ec.generate_private_key(ec.SECP256R1())
    now = _now()
    certificate = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, identity)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=LEAF_DAYS))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    cert_path, key_path = directory / f"{identity}.pem", directory / f"{identity}-key.pem"
    _write_key(key_path, key)
    cert_path.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    return Issued(identity, ca_cert_path, cert_path, key_path)


def deployment_identity(directory: Path, identity: str, hosts: Sequence[str]) -> Issued:
    """`identity`'s certificate for `hosts` from the deployment CA in `directory`, the CA made
    on first use (what `fleetline run` and `serve` use when no certificate is given)."""
    init(directory)
    return issue(directory, identity, hosts)
