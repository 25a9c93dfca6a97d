"""The channel between the leaders of a job's parts in different clusters: TCP, every message
sealed with AES-256-GCM under a key of the job's run alone, derived from the tenant's key (the
one its checkpoints are sealed with) and bound to the job, its epoch and its attempt.

Sealing is the authentication: a peer without the tenant's key, or one from another run of the
job (a fenced attempt still running after a link came back), cannot make a message this run
opens, and is refused at the handshake. Each message's nonce is its sender's part index and a
counter, and its kind is the associated data, so a message replayed, reordered or passed off as
another kind fails to open. How the root's address is found: `publish_address` and
`wait_address`, an object sealed the same way in the root cluster's store.
"""

from __future__ import annotations

import socket
import struct
import time
from dataclasses import dataclass, field

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from fleetline.errors import (
    FleetlineError,
    IntegrityError,
    ObjectMissing,
    ServiceUnavailable,
    TransientStorageError,
)
from fleetline.storage.crypto import ObjectCipher
from fleetline.storage.objects import ObjectStore

_FRAME = struct.Struct("!IQ")  # sealed length, counter
MAX_MESSAGE = 256 * 2**20


class DataPlaneError(FleetlineError):
    """A part of the job cannot be reached, or what it sent cannot be trusted."""


def run_key(tenant_key: bytes, job: str, epoch: int, attempt: int) -> bytes:
    """The key of one run of a job's data plane (its parts' channel and rendezvous)."""
    return HKDF(
        algorithm=hashes.SHA256(),
        length=32,
        salt=None,
        info=f"fleetline data plane/{job}/{epoch}/{attempt}".encode(),
    ).derive(tenant_key)


@dataclass
class SealedChannel:
    """One connection between two leaders; `me` and `peer` are their parts' indices."""

    sock: socket.socket
    key: bytes
    me: int
    peer: int
    sent_bytes: int = 0
    received_bytes: int = 0
    _sent: int = 0
    _received: int = 0
    _aead: AESGCM = field(init=False)

    def __post_init__(self) -> None:
        self._aead = AESGCM(self.key)

    def _nonce(self, sender: int, counter: int) -> bytes:
        return struct.pack("!IQ", sender, counter)

    def send(self, kind: str, payload: bytes) -> None:
        sealed = self._aead.encrypt(self._nonce(self.me, self._sent), payload, kind.encode())
        frame = _FRAME.pack(len(sealed), self._sent) + sealed
        self._sent += 1
        try:
            self.sock.sendall(frame)
        except OSError as exc:
            raise DataPlaneError(f"sending {kind} to part {self.peer}: {exc}") from exc
        self.sent_bytes += len(frame)

    def recv(self, kind: str) -> bytes:
        header = self._read(_FRAME.size, kind)
        length, counter = _FRAME.unpack(header)
        if length > MAX_MESSAGE:
            raise DataPlaneError(f"part {self.peer} sent a {length}-byte {kind}: refused")
        if counter != self._received:
            raise DataPlaneError(
                f"part {self.peer} sent message {counter} where {self._received} was due"
            )
        sealed = self._read(length, kind)
        try:
            payload = self._aead.decrypt(self._nonce(self.peer, counter), sealed, kind.encode())
        except InvalidTag:
            raise DataPlaneError(
                f"a {kind} from part {self.peer} does not open under this run's key "
                "(another tenant's or another attempt's peer, or altered on the way)"
            ) from None
        self._received += 1
        self.received_bytes += _FRAME.size + length
        return payload

    def _read(self, size: int, kind: str) -> bytes:
        return read_exact(self.sock, size, f"part {self.peer}", kind)

    def close(self) -> None:
        self.sock.close()


def read_exact(sock: socket.socket, size: int, peer: str, kind: str) -> bytes:
    """`size` bytes from `sock`, or DataPlaneError naming the peer and what was awaited."""
    chunks, left = [], size
    while left:
        try:
            chunk = sock.recv(min(left, 1 << 20))
        except OSError as exc:  # a timeout included: the peer went silent
            raise DataPlaneError(f"waiting for a {kind} from {peer}: {exc}") from exc
        if not chunk:
            raise DataPlaneError(f"{peer} closed the channel (waiting for {kind})")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def publish_address(store: ObjectStore, key: str, run: bytes, address: str) -> None:
    store.put(key, ObjectCipher(run).seal(key, address.encode()))


def wait_address(store: ObjectStore, key: str, run: bytes, timeout_s: float) -> str:
    """The root's address, once its leader has published it (polled: the parts start in
    different clusters, at different times)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            blob = store.get(key)
        except (ObjectMissing, ServiceUnavailable, TransientStorageError) as exc:
            if time.monotonic() > deadline:
                raise DataPlaneError(
                    f"the root part published no address at {key} in {timeout_s:.0f} s ({exc})"
                ) from exc
            time.sleep(0.1)
            continue
        try:
            return ObjectCipher(run).open(key, blob).decode()
        except IntegrityError as exc:
            raise DataPlaneError(f"the root's address: {exc}") from exc
