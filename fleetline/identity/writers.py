"""Who wrote a record: writer identities, the MAC each record carries, and the gate that checks it.

Kubernetes' NodeRestriction is the model: the broker authenticates a *kind* of process per
topic (SASL/SCRAM, ACLs), and inside a kind each record names its writer and proves it. A writer
is `kind:name` (`node:eu-west-a/eu-west-a-n0001`, `cluster:eu-west-a`, `mover:serve`,
`router:edge`, `control-plane`) at a generation; its key is derived from the deployment's
identity root, which only the control plane holds:

    key(writer, generation) = HMAC-SHA256(root, "fleetline writer key" | writer "#" generation)

`fleetline enroll` hands a host the keys of the writers it runs and nothing else. Every record a
writer produces carries two headers, the writer and a MAC over the topic, key and value (GMAC:
AES-256-GCM with the record as associated data, under a nonce the producer never repeats), so a
record copied to another topic, re-keyed or edited does not verify. The gate (control plane,
replays) derives the same key and checks the MAC: the writer is established, not claimed.
A symmetric MAC, not signatures: the view folds ~50k telemetry records a second per core and
Ed25519's verify costs ~120 us a record here, GMAC under 1 us (docs/security.md weighs it).

Revocation is an event on the identities topic (`IdentityEvent`): a writer's generations up to
the revoked one are refused for every record the broker appended at or after the revocation
(both times are the broker's LogAppendTime), in the live folds and in every replay alike.

Pure: no clock, no I/O; the keys and the registry are inputs.
"""

from __future__ import annotations

import hmac
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from fleetline.errors import ConfigError, FleetlineError

H_WRITER = "fleetline.writer"
H_MAC = "fleetline.mac"
NONCE_BYTES = 12
_FRAME = struct.Struct(">Iii")
MAC_BYTES = NONCE_BYTES + 16  # the nonce, then GMAC's tag
_KEY_LABEL = b"fleetline writer key\0"


class WriterKind(StrEnum):
    CONTROL_PLANE = "control-plane"
    NODE = "node"
    CLUSTER = "cluster"
    MOVER = "mover"
    ROUTER = "router"


class WriterRefused(FleetlineError):
    """A record whose writer is not established (no MAC, a wrong one, a revoked identity) or
    who may not write it: dead-lettered with this reason, never applied."""

    def __init__(self, writer: str, reason: str) -> None:
        super().__init__(f"{writer} {reason}")
        self.writer = writer


@dataclass(frozen=True, slots=True)
class Writer:
    kind: WriterKind
    name: str = ""  # empty for the control plane
    generation: int = 1
    # The cluster a node or cluster writer speaks for, and a node writer's node (a node is
    # named `cluster/node`): worked out once, as every record's check asks.
    cluster: str | None = field(init=False, compare=False, repr=False, default=None)
    node: str | None = field(init=False, compare=False, repr=False, default=None)

    def __post_init__(self) -> None:
        if self.kind is WriterKind.CLUSTER:
            object.__setattr__(self, "cluster", self.name)
        elif self.kind is WriterKind.NODE:
            cluster, _, node = self.name.partition("/")
            object.__setattr__(self, "cluster", cluster)
            object.__setattr__(self, "node", node)

    @property
    def id(self) -> str:
        """`kind:name` (the control plane has no name), without the generation."""
        return self.kind.value if not self.name else f"{self.kind.value}:{self.name}"

    def __str__(self) -> str:
        return self.id

    @property
    def header(self) -> str:
        return f"{self.id}#{self.generation}"

    @property
    def is_control_plane(self) -> bool:
        return self.kind is WriterKind.CONTROL_PLANE

    @classmethod
    def parse(cls, text: str) -> Writer:
        """`kind:name[#generation]` (or `control-plane[#generation]`), checked."""
        ident, _, generation = text.partition("#")
        kind_text, _, name = ident.partition(":")
        try:
            kind = WriterKind(kind_text)
        except ValueError:
            kinds = ", ".join(k.value for k in WriterKind)
            raise ConfigError(f"writer {text!r}: the kind must be one of {kinds}") from None
        if kind is WriterKind.CONTROL_PLANE and name:
            raise ConfigError(f"writer {text!r}: the control plane has no name")
        if kind is not WriterKind.CONTROL_PLANE and not name:
            raise ConfigError(f"writer {text!r}: a {kind} writer needs a name")
        if kind is WriterKind.NODE and (name.count("/") != 1 or not all(name.partition("/")[::2])):
            raise ConfigError(f"writer {text!r}: a node is named cluster/node")
        try:
            number = int(generation) if generation else 1
        except ValueError:
            raise ConfigError(f"writer {text!r}: the generation must be a number") from None
        if number < 1:
            raise ConfigError(f"writer {text!r}: generations start at 1")
        return cls(kind, name, number)


CONTROL_PLANE_WRITER = Writer(WriterKind.CONTROL_PLANE)


def writer_key(root: bytes, writer: Writer) -> bytes:
    """The key of `writer` at its generation, derived from the deployment's identity root."""
    return hmac.digest(root, _KEY_LABEL + writer.header.encode(), "sha256")


def authenticated_bytes(topic: bytes, msg_key: bytes | None, value: bytes | None) -> bytes:
    """What a record's MAC covers: its topic, key and value, each length-framed (so no two
    different records frame to the same bytes; None and empty differ)."""
    frame = _FRAME.pack(
        len(topic), -1 if msg_key is None else len(msg_key), -1 if value is None else len(value)
    )
    return b"".join((frame, topic, msg_key or b"", value or b""))


def record_mac(
    key: AESGCM, nonce: bytes, topic: bytes, msg_key: bytes | None, value: bytes | None
) -> bytes:
    """The MAC of one record: GMAC (AES-256-GCM over no plaintext, the record as associated
    data) under a nonce never used twice with the key; the nonce travels with the tag."""
    if len(nonce) != NONCE_BYTES:
        raise ConfigError(f"a record's nonce is {NONCE_BYTES} bytes")
    return nonce + key.encrypt(nonce, b"", authenticated_bytes(topic, msg_key, value))


@dataclass(frozen=True, slots=True)
class Credential:
    """What a writer holds: who it is and its key."""

    writer: Writer
    key: bytes
    aead: AESGCM = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "aead", AESGCM(self.key))

    def __reduce__(self) -> tuple[Any, ...]:
        # A process started by `spawn` (the router's) gets its settings pickled: the cipher
        # is made again from the key there.
        return (Credential, (self.writer, self.key))

    def headers(
        self, topic: str, msg_key: bytes | None, value: bytes | None, nonce: bytes
    ) -> list[tuple[str, bytes]]:
        """The two headers a record carries; `nonce` must never repeat under this key (the
        producer makes them: a random prefix per producer and a counter)."""
        return [
            (H_WRITER, self.writer.header.encode()),
            (H_MAC, record_mac(self.aead, nonce, topic.encode(), msg_key, value)),
        ]


@dataclass(frozen=True)
class Signer:
    """The credentials a process writes with: a node agent speaking for several nodes picks
    each record's by its key (the node id); any other record, and every record of a process
    with one identity, is written under the first."""

    credentials: tuple[Credential, ...]
    # node id -> its credential (a node agent's several nodes), worked out once.
    by_node: dict[bytes, Credential] = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not self.credentials:
            raise ConfigError("a signer needs at least one credential")
        object.__setattr__(
            self,
            "by_node",
            {
                (c.writer.node or "").encode(): c
                for c in self.credentials
                if c.writer.kind is WriterKind.NODE
            },
        )

    @property
    def writers(self) -> tuple[Writer, ...]:
        return tuple(c.writer for c in self.credentials)

    def credential_for(self, msg_key: bytes | None) -> Credential:
        if msg_key is not None and len(self.credentials) > 1:
            found = self.by_node.get(msg_key)
            if found is not None:
                return found
        return self.credentials[0]

    def headers(
        self, topic: str, msg_key: bytes | None, value: bytes | None, nonce: bytes
    ) -> list[tuple[str, bytes]]:
        return self.credential_for(msg_key).headers(topic, msg_key, value, nonce)


class Headed(Protocol):
    """A record as the gate reads it (`confluent_kafka.Message` is one)."""

    def topic(self) -> str | None: ...

    def key(self) -> bytes | None: ...

    def value(self) -> bytes | None: ...

    def headers(self) -> Any: ...  # [(name, value)] as confluent_kafka gives them, or None

    def timestamp(self) -> tuple[int, int]: ...


class EstablishesWriters(Protocol):
    """What folds ask who wrote a record: a Gate, or the live one over the identities topic."""

    def new_batch(self, records: Iterable[Headed]) -> None:
        """A batch was fetched (a live gate reads the revocations again before judging it)."""

    def writer_of(self, record: Headed) -> Writer:
        """The record's established writer, or WriterRefused saying why there is none."""
        ...


@dataclass(frozen=True, slots=True)
class Revocation:
    """A writer's generations up to `generation` refused from `from_ms` (broker time) on."""

    writer: str
    generation: int
    from_ms: int
    by: str = ""
    reason: str = ""


@dataclass
class Registry:
    """The fold of the identities topic: who was enrolled, who was revoked and when."""

    enrolled: dict[str, int] = field(default_factory=dict)  # writer id -> latest generation
    revoked: dict[str, Revocation] = field(default_factory=dict)
    position: int = 0  # the next offset of the identities topic

    def apply(self, event: Mapping[str, Any], appended_ms: int, offset: int) -> None:
        writer = Writer.parse(f"{event['writer']}#{event['generation']}")
        if event["action"] == "REVOKE":
            before = self.revoked.get(writer.id)
            if before is None or before.generation < writer.generation:
                self.revoked[writer.id] = Revocation(
                    writer.id,
                    writer.generation,
                    appended_ms,
                    event.get("actor") or "",
                    event.get("reason") or "",
                )
        elif event["action"] == "ENROL":
            self.enrolled[writer.id] = max(self.enrolled.get(writer.id, 0), writer.generation)
        self.position = max(self.position, offset + 1)

    def next_generation(self, writer_id: str) -> int:
        """The generation a new enrolment of `writer_id` gets: past every revoked one."""
        revoked = self.revoked.get(writer_id)
        return max(self.enrolled.get(writer_id, 0), revoked.generation if revoked else 0) + 1

    def refusal(self, writer: Writer, appended_ms: int | None) -> str | None:
        revoked = self.revoked.get(writer.id)
        if revoked is None or writer.generation > revoked.generation:
            return None
        if appended_ms is not None and appended_ms < revoked.from_ms:
            return None
        return (
            f"was revoked (generation {revoked.generation} and older, from broker time "
            f"{revoked.from_ms} on{', by ' + revoked.by if revoked.by else ''}"
            f"{': ' + revoked.reason if revoked.reason else ''})"
        )


# confluent_kafka.TIMESTAMP_LOG_APPEND_TIME
_LOG_APPEND_TIME = 2


class Gate:
    """Establishes each record's writer: the MAC by the key derived from the root, and no
    revocation in force when the broker appended it. Raises WriterRefused saying why not."""

    def __init__(self, root: bytes, registry: Registry | None = None) -> None:
        if len(root) < 32:
            raise ConfigError("the identity root key must be at least 32 bytes")
        self._root = root
        self.registry = registry or Registry()
        self._keys: dict[bytes, tuple[Writer, Any]] = {}
        self._topics: dict[str, bytes] = {}

    def new_batch(self, records: Iterable[Headed]) -> None:
        """Nothing to read again: this gate's registry is given whole."""

    def credential(self, writer: Writer) -> Credential:
        """A writer's credential (what `fleetline enroll` hands its host)."""
        return Credential(writer, writer_key(self._root, writer))

    def _known(self, header: bytes) -> tuple[Writer, Any]:
        found = self._keys.get(header)
        if found is None:
            try:
                writer = Writer.parse(header.decode(errors="replace"))
            except ConfigError as exc:
                raise WriterRefused("an unknown writer", f"names no valid writer: {exc}") from None
            found = (writer, AESGCM(writer_key(self._root, writer)))
            if len(self._keys) < 100_000:
                self._keys[header] = found
        return found

    def writer_of(self, record: Headed) -> Writer:
        # Every record of every checked topic comes through here: kept to a few lookups and
        # one GMAC (benchmarks/writers.py measures it against the view's fold).
        headers = record.headers()
        claimed, mac = _identity_headers(headers)
        if claimed is None or mac is None:
            raise WriterRefused("an unauthenticated writer", "wrote a record with no writer MAC")
        found = self._keys.get(claimed)
        writer, aead = found if found is not None else self._known(claimed)
        topic = record.topic() or ""
        topic_bytes = self._topics.get(topic)
        if topic_bytes is None:
            topic_bytes = self._topics[topic] = topic.encode()
        try:
            aead.decrypt(
                mac[:NONCE_BYTES],
                mac[NONCE_BYTES:],
                authenticated_bytes(topic_bytes, record.key(), record.value()),
            )
        except (InvalidTag, ValueError):  # ValueError: a tag or nonce of the wrong length
            raise WriterRefused(
                "an unauthenticated writer",
                f"claims to be {writer.header}: the MAC does not verify",
            ) from None
        if self.registry.revoked:
            kind, ms = record.timestamp()
            refusal = self.registry.refusal(writer, ms if kind == _LOG_APPEND_TIME else None)
            if refusal is not None:
                raise WriterRefused(writer.header, refusal)
        return writer


def _identity_headers(headers: Any) -> tuple[bytes | None, bytes | None]:
    # A signing producer puts the two last: look there first (every record is checked).
    if headers.__class__ is list and len(headers) >= 2:
        (first, writer), (second, mac) = headers[-2], headers[-1]
        if first == H_WRITER and second == H_MAC and writer.__class__ is bytes:
            return writer, mac
    writer = mac = None
    pairs = headers.items() if isinstance(headers, Mapping) else headers or ()
    for name, value in pairs:
        if value.__class__ is str:
            value = value.encode()
        if name == H_WRITER:
            writer = value
        elif name == H_MAC:
            mac = value
    return writer, mac


def writer_header(headers: Any) -> str | None:
    """The writer a record claims, read as the gate reads it (unverified: for showing a dead
    letter or choosing whether to read the revocations again, never for trust)."""
    writer, _ = _identity_headers(headers)
    return None if writer is None else writer.decode(errors="replace")
