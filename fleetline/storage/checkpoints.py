"""Training checkpoints in a cluster's object store: parts first, the manifest last.

A checkpoint lives under `<job prefix>/e<epoch>-s<step>/`: its parts, then `MANIFEST.json` with
each part's size and SHA-256 (of the bytes stored). It is complete only when the manifest is
there and every part matches it; a torn one (a part missing, a digest wrong, a manifest that
does not parse) is passed over, never resumed from. Checkpoints order by (epoch, step): a copy
of a job fenced off a lost cluster may go on writing under its old epoch, and what it writes
never outranks the epoch that replaced it.

With a tenant key the parts are sealed (AES-256-GCM) under a fresh data key per checkpoint, and
the manifest carries that data key sealed under the tenant's key (an envelope): copying a
checkpoint between clusters moves ciphertext only, and the copy is verified on arrival.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from fleetline.errors import IntegrityError, ObjectMissing, StorageError
from fleetline.storage.crypto import ObjectCipher
from fleetline.storage.objects import Objects

FORMAT = "fleetline.checkpoint/1"
_PARALLEL_PARTS = 8
T = TypeVar("T")
# Whether a checkpoint (epoch, step) may be resumed from.
Admit = Callable[[int, int], bool]
MANIFEST = "MANIFEST.json"
_NAME = re.compile(r"^e(?P<epoch>\d{10})-s(?P<step>\d{12})$")


def cluster_bucket(base: str, cluster_id: str) -> str:
    """The bucket of a cluster's own object store (one per cluster)."""
    return f"{base}-{cluster_id}".lower()[:63].rstrip("-")


def derived_key(master_key: bytes, purpose: str, tenant: str) -> bytes:
    """A tenant's key for one purpose, derived from the operator's object-encryption key
    (HKDF-SHA256; a key of one purpose or tenant tells nothing of another's)."""
    return HKDF(
        algorithm=hashes.SHA256(),
        length=32,
        salt=None,
        info=f"fleetline {purpose}/{tenant}".encode(),
    ).derive(master_key)


def tenant_key(master_key: bytes, tenant: str) -> bytes:
    """The tenant's checkpoint key."""
    return derived_key(master_key, "checkpoints", tenant)


def checkpoint_name(epoch: int, step: int) -> str:
    return f"e{epoch:010d}-s{step:012d}"


def params_digest(arrays: Mapping[str, Any]) -> str:
    """SHA-256 over named arrays (name, dtype, shape, bytes), in name order: equal exactly when
    every parameter is bit-identical."""
    digest = hashlib.sha256()
    for name in sorted(arrays):
        a = arrays[name]
        digest.update(f"{name}|{a.dtype.str}|{a.shape}|".encode())
        digest.update(a.tobytes())
    return digest.hexdigest()


@dataclass(frozen=True)
class Manifest:
    name: str
    epoch: int
    step: int
    parts: dict[str, dict[str, Any]]
    meta: dict[str, Any]
    sealed: bool
    data_key: str | None  # sealed under the tenant key, base64

    @property
    def bytes(self) -> int:
        return sum(int(p["bytes"]) for p in self.parts.values())


@dataclass
class Checkpoints:
    """One job's checkpoints in one store."""

    store: Objects
    prefix: str  # checkpoints/<tenant>/<job name>
    key: bytes | None = None  # the tenant's key; None: parts are stored as they are
    skipped: list[str] = field(default_factory=list)  # torn checkpoints passed over, and why

    def _key(self, name: str, part: str) -> str:
        return f"{self.prefix}/{name}/{part}"

    def save(
        self, epoch: int, step: int, parts: Mapping[str, bytes], meta: Mapping[str, Any]
    ) -> tuple[Manifest, float]:
        """Write the parts, then the manifest; (the manifest, seconds taken)."""
        began = time.perf_counter()
        name = checkpoint_name(epoch, step)
        data_key = os.urandom(32) if self.key is not None else None
        cipher = ObjectCipher(data_key) if data_key is not None else None

        def write(part: str) -> dict[str, Any]:
            key = self._key(name, part)
            blob = cipher.seal(key, parts[part]) if cipher is not None else parts[part]
            self.store.put(key, blob)
            return {"bytes": len(blob), "sha256": hashlib.sha256(blob).hexdigest()}

        digests = dict(zip(sorted(parts), _each(write, sorted(parts)), strict=True))
        manifest_key = self._key(name, MANIFEST)
        wrapped = (
            base64.b64encode(ObjectCipher(self.key).seal(manifest_key, data_key)).decode()
            if self.key is not None and data_key is not None
            else None
        )
        manifest = Manifest(name, epoch, step, digests, dict(meta), cipher is not None, wrapped)
        self.store.put(manifest_key, _manifest_bytes(manifest), "application/json")
        return manifest, time.perf_counter() - began

    def names(self) -> list[str]:
        """Checkpoints with a manifest, newest (epoch, step) first; complete or not."""
        names = set()
        for key in self.store.keys(self.prefix + "/"):
            rest = key[len(self.prefix) + 1 :]
            name, _, part = rest.partition("/")
            if part == MANIFEST and _NAME.match(name):
                names.add(name)
        return sorted(names, reverse=True)

    def manifest(self, name: str) -> Manifest:
        try:
            data = json.loads(self.store.get(self._key(name, MANIFEST)))
            if data.get("format") != FORMAT:
                raise IntegrityError(f"{name}: not a {FORMAT} manifest")
            return Manifest(
                name,
                int(data["epoch"]),
                int(data["step"]),
                {p: dict(v) for p, v in data["parts"].items()},
                dict(data["meta"]),
                bool(data["sealed"]),
                data.get("data_key"),
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise IntegrityError(f"{name}: manifest does not parse: {exc}") from None

    def _blob(self, manifest: Manifest, part: str, digest: bool = True) -> bytes:
        """A part as stored, its size and (with `digest`) its SHA-256 checked against the
        manifest."""
        expected = manifest.parts[part]
        try:
            blob = self.store.get(self._key(manifest.name, part))
        except ObjectMissing:
            raise IntegrityError(f"{manifest.name}: part {part} is missing") from None
        if len(blob) != expected["bytes"] or (
            digest and hashlib.sha256(blob).hexdigest() != expected["sha256"]
        ):
            raise IntegrityError(f"{manifest.name}: part {part} does not match its digest")
        return blob

    def load(self, name: str) -> tuple[Manifest, dict[str, bytes]]:
        """A complete checkpoint's manifest and parts (opened), or IntegrityError."""
        manifest = self.manifest(name)
        cipher = self._cipher(manifest)

        def read(part: str) -> bytes:
            # A sealed part is authenticated by its decryption (AES-GCM under the checkpoint's
            # own data key, its object key bound in): a torn, altered or swapped part fails
            # there, so hashing it first as well would only double the work.
            blob = self._blob(manifest, part, digest=cipher is None)
            return cipher.open(self._key(name, part), blob) if cipher is not None else blob

        names = sorted(manifest.parts)
        return manifest, dict(zip(names, _each(read, names), strict=True))

    def _cipher(self, manifest: Manifest) -> ObjectCipher | None:
        """What opens the checkpoint's parts (None: stored as they are), or IntegrityError
        when its data key does not open under this store's tenant key."""
        if not manifest.sealed:
            return None
        if self.key is None or manifest.data_key is None:
            raise IntegrityError(f"{manifest.name}: sealed, and no tenant key to open it")
        try:
            wrapped = base64.b64decode(manifest.data_key, validate=True)
        except ValueError:
            raise IntegrityError(f"{manifest.name}: its data key is not base64") from None
        return ObjectCipher(
            ObjectCipher(self.key).open(self._key(manifest.name, MANIFEST), wrapped)
        )

    def complete(self, name: str) -> Manifest | None:
        """The manifest when every part is there and matches and its key opens, else None
        (noted in skipped)."""
        try:
            manifest = self.manifest(name)
            self._cipher(manifest)
            _each(lambda part: self._blob(manifest, part), sorted(manifest.parts))
            return manifest
        except (IntegrityError, ObjectMissing) as exc:
            self.skipped.append(str(exc))
            return None

    def latest(self) -> tuple[Manifest, dict[str, bytes]] | None:
        """The newest complete checkpoint, opened; torn ones are passed over."""
        for name in self.names():
            try:
                return self.load(name)
            except (IntegrityError, ObjectMissing) as exc:
                self.skipped.append(str(exc))
        return None

    def newest_complete(self, admit: Admit | None = None) -> Manifest | None:
        """The newest complete checkpoint that `admit(epoch, step)` accepts (any by default)."""
        for name in self.names():
            match = _NAME.match(name)
            if admit is not None and match and not admit(int(match["epoch"]), int(match["step"])):
                continue
            manifest = self.complete(name)
            if manifest is not None:
                return manifest
        return None

    def copy_to(self, target: Checkpoints, name: str) -> tuple[int, float]:
        """Copy a complete checkpoint into another store (ciphertext as stored), verifying each
        part there after writing it, the manifest last; (bytes, seconds)."""
        began = time.perf_counter()
        manifest = self.manifest(name)

        def move(part: str) -> None:
            target.store.put(target._key(name, part), self._blob(manifest, part))
            target._blob(manifest, part)  # read back: verified on arrival

        _each(move, sorted(manifest.parts))
        target.store.put(target._key(name, MANIFEST), _manifest_bytes(manifest), "application/json")
        return manifest.bytes, time.perf_counter() - began


def _each(work: Callable[[str], T], parts: list[str]) -> list[T]:
    """`work` over the parts, several at a time (S3 round trips, hashing and AES-GCM all
    release the GIL), results in the parts' order; the first error is raised."""
    if len(parts) <= 1:
        return [work(p) for p in parts]
    with ThreadPoolExecutor(max_workers=min(_PARALLEL_PARTS, len(parts))) as pool:
        return list(pool.map(work, parts))


def _manifest_bytes(manifest: Manifest) -> bytes:
    return json.dumps(
        {
            "format": FORMAT,
            "epoch": manifest.epoch,
            "step": manifest.step,
            "parts": manifest.parts,
            "meta": manifest.meta,
            "sealed": manifest.sealed,
            "data_key": manifest.data_key,
        },
        sort_keys=True,
    ).encode()


def best_of(
    stores: list[Checkpoints], admit: Admit | None = None
) -> tuple[Checkpoints, Manifest] | None:
    """The newest complete checkpoint across stores that `admit` accepts (the first store wins
    a tie: the local one)."""
    best: tuple[Checkpoints, Manifest] | None = None
    for store in stores:
        try:
            manifest = store.newest_complete(admit)
        except StorageError as exc:
            store.skipped.append(f"{store.prefix}: {exc}")
            continue
        if manifest is not None and (
            best is None or (manifest.epoch, manifest.step) > (best[1].epoch, best[1].step)
        ):
            best = (store, manifest)
    return best
