"""Where identity keys live: the deployment's identity root (control plane only) and the
credential files `fleetline enroll` hands each agent host.

The root is `FLEETLINE_IDENTITY_ROOT_KEY` (32 bytes, base64) or `.cache/keys/identity-root.key`,
made owner-only on the control plane's first start like the audit signing key. A credential
file (`FLEETLINE_IDENTITY_FILE`, owner-only JSON) holds the writers a host runs and their keys,
never the root.
"""

from __future__ import annotations

import base64
import json
import os
from collections.abc import Iterable
from pathlib import Path

from fleetline.errors import ConfigError
from fleetline.identity.writers import Credential, Signer, Writer, writer_key


def root_key_path(cache_dir: Path) -> Path:
    return cache_dir / "keys" / "identity-root.key"


def read_root(path: Path, *, create: bool) -> bytes | None:
    """The root key at `path`; made (random, owner-only) when absent and `create`. Another
    user of the host, who may not read it, holds none (its records go unsigned) unless it is
    to `create` it: then a ConfigError names the file."""
    try:
        return _read_root(path, create=create)
    except PermissionError:
        if create:
            raise ConfigError(
                f"{path}: the identity root key may not be read by this user"
            ) from None
        return None


def _read_root(path: Path, *, create: bool) -> bytes | None:
    if not path.exists():
        if not create:
            return None
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:  # another process of this deployment made it meanwhile
            return decode_root(path.read_text(), str(path))
        with os.fdopen(descriptor, "w") as handle:
            handle.write(base64.b64encode(os.urandom(32)).decode())
    return decode_root(path.read_text(), str(path))


def decode_root(text: str, where: str) -> bytes:
    try:
        root = base64.b64decode(text.strip(), validate=True)
    except ValueError:
        raise ConfigError(f"{where}: the identity root key is not base64") from None
    if len(root) < 32:
        raise ConfigError(f"{where}: the identity root key must be at least 32 bytes")
    return root


def derive(root: bytes, writers: Iterable[Writer]) -> Signer:
    return Signer(tuple(Credential(w, writer_key(root, w)) for w in writers))


def write_credentials(path: Path, credentials: Iterable[Credential]) -> None:
    """An owner-only credential file (replaced whole, never left half written)."""
    data = [
        {"writer": c.writer.header, "key": base64.b64encode(c.key).decode()} for c in credentials
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    descriptor = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w") as handle:
        json.dump(data, handle, indent=1)
    os.replace(partial, path)


def read_credentials(path: Path) -> Signer:
    try:
        data = json.loads(path.read_text())
        credentials = tuple(
            Credential(Writer.parse(item["writer"]), base64.b64decode(item["key"], validate=True))
            for item in data
        )
    except OSError as exc:
        raise ConfigError(f"identity file {path}: {exc.strerror}") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"identity file {path}: not a credential list ({exc})") from None
    if not credentials:
        raise ConfigError(f"identity file {path} holds no credential")
    return Signer(credentials)


def signer_for(
    writers: Iterable[Writer], *, root: bytes | None, identity_file: Path | None
) -> Signer:
    """Credentials for `writers` (each at the generation the file holds, or 1): from this
    host's credential file, else derived from the root where this host holds it."""
    wanted = list(writers)
    if identity_file is not None:
        held = {c.writer.id: c for c in read_credentials(identity_file).credentials}
        missing = [w.id for w in wanted if w.id not in held]
        if missing:
            raise ConfigError(
                f"identity file {identity_file} holds no credential for {', '.join(missing)}: "
                f"run `fleetline enroll` for it on the control plane's host"
            )
        return Signer(tuple(held[w.id] for w in wanted))
    if root is None:
        raise ConfigError(
            f"no credential for {', '.join(w.id for w in wanted)} on this host: run `fleetline "
            "enroll` for it on the control plane's host and give this host the file it writes "
            "as FLEETLINE_IDENTITY_FILE"
        )
    return derive(root, wanted)
