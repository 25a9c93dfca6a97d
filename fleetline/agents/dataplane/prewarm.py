"""A dataset prewarm: the dataset's objects copied from one cluster's store into another's,
each verified by its digest on arrival, at no more than the rate the scheduler granted.

A dataset's objects sit under one key prefix (spec.source, else datasets/<tenant>/<name>/) with
a manifest, `MANIFEST.json` there: every object's size and SHA-256, written when the dataset is
uploaded (`upload`, which `fleetline run` uses), or made once here, by reading the source, when it
has none.
A copy goes object by object: read from the source at the granted rate (the schedule is
`bytes / rate` from the copy's start, so a slow write is made up and a fast one waits), its
digest checked against the manifest (a mismatch is fetched again, at most `FETCHES` times), then
written and read back from the target and checked once more (what arrived, not what was sent).
The manifest is written to the target last: a replica with a manifest is complete.

A copy that leaves the source's region masks the dataset's sensitive fields first: every record
(a JSON object a line) gets those fields replaced by a keyed hash (HMAC-SHA256 under a key the
deployment's object-encryption key derives for the tenant: the same value hashes the same, so
joins and counts still work, and nobody without the key can test a guess). An object that is not
JSON lines cannot be masked and is not copied. The target's manifest lists the masked bytes.

A copy killed half-way starts again where it was: an object already in the target with the
manifest's size is read back and kept if its digest holds (fetched again if not, so a torn or
tampered object never passes); the manifest comes last, whatever happened before.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from fleetline.errors import FleetlineError, ObjectMissing
from fleetline.storage.checkpoints import derived_key
from fleetline.storage.objects import ObjectStore

MANIFEST = "MANIFEST.json"
FETCHES = 3  # tries at one object before the copy gives up
CHUNK = 1 << 18

Progress = Callable[[int, int], None]  # (bytes copied and verified, bytes in all)


class CopyError(FleetlineError):
    """A copy that cannot complete: the source's objects do not match their manifest, or a
    store refused; the replica is not marked ready."""


@dataclass(frozen=True)
class Entry:
    key: str  # below the dataset's prefix
    size: int
    sha256: str


@dataclass
class Throttle:
    """At most `bytes_per_s` on average from the first byte: a byte may pass once the copy's
    elapsed time covers every byte before it at that rate (a stalled write is made up after,
    never exceeded over the copy)."""

    bytes_per_s: float
    _start: float | None = None
    passed: int = 0

    def take(self, n: int, stop: threading.Event) -> None:
        if self._start is None:
            self._start = time.monotonic()
        self.passed += n
        if self.bytes_per_s > 0:
            wait = self._start + self.passed / self.bytes_per_s - time.monotonic()
            if wait > 0:
                stop.wait(wait)

    @property
    def elapsed_s(self) -> float:
        return 0.0 if self._start is None else time.monotonic() - self._start


def mask_key(master: bytes, tenant: str) -> bytes:
    """The tenant's masking key, derived from the deployment's object-encryption key."""
    return derived_key(master, "masking", tenant)


@dataclass(frozen=True)
class Mask:
    """Which fields of each record are masked, under which key."""

    fields: tuple[str, ...]
    key: bytes

    def value(self, value: object) -> str:
        encoded = json.dumps(value, sort_keys=True).encode()
        return "masked:" + hmac.new(self.key, encoded, hashlib.sha256).hexdigest()[:32]

    def apply(self, name: str, data: bytes) -> bytes:
        """The object's records with the fields masked; CopyError if it is not JSON lines."""
        why = f"{name}: its sensitive fields cannot be masked, so it does not leave its region"
        try:
            lines = data.decode("utf-8").splitlines()
        except UnicodeDecodeError:
            raise CopyError(f"{why} (not UTF-8 JSON lines)") from None
        out = []
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError:
                raise CopyError(f"{why} (line {number} is not JSON)") from None
            if not isinstance(record, dict):
                raise CopyError(f"{why} (line {number} is not a JSON object)")
            for field in self.fields:
                if field in record:
                    record[field] = self.value(record[field])
            out.append(json.dumps(record, sort_keys=True, separators=(",", ":")))
        return ("\n".join(out) + "\n").encode() if out else b""


def read_manifest(store: ObjectStore, prefix: str) -> list[Entry] | None:
    try:
        data = json.loads(store.get(prefix + MANIFEST))
    except ObjectMissing:
        return None
    except ValueError as exc:
        raise CopyError(f"s3://{store.bucket}/{prefix}{MANIFEST} is not JSON: {exc}") from None
    try:
        return [Entry(e["key"], int(e["size"]), str(e["sha256"])) for e in data["objects"]]
    except (KeyError, TypeError, ValueError) as exc:
        raise CopyError(f"s3://{store.bucket}/{prefix}{MANIFEST}: bad entry ({exc})") from None


def manifest_bytes(entries: list[Entry]) -> bytes:
    return json.dumps(
        {"objects": [{"key": e.key, "size": e.size, "sha256": e.sha256} for e in entries]},
        indent=1,
        sort_keys=True,
    ).encode()


def upload(store: ObjectStore, prefix: str, objects: dict[str, bytes]) -> list[Entry]:
    """Write a dataset's objects under `prefix` and its manifest (as `fleetline run`'s prewarm
    story does); returns the manifest's entries."""
    store.ensure_bucket()
    entries = []
    for key in sorted(objects):
        data = objects[key]
        store.put(prefix + key, data)
        entries.append(Entry(key, len(data), hashlib.sha256(data).hexdigest()))
    store.put(prefix + MANIFEST, manifest_bytes(entries), "application/json")
    return entries


def manifest_of(store: ObjectStore, prefix: str) -> list[Entry]:
    """The source's manifest; made (by reading every object once) where it has none."""
    entries = read_manifest(store, prefix)
    if entries is not None:
        return entries
    made = [
        _entry(store, prefix, key[len(prefix) :])
        for key in store.keys(prefix)
        if key != prefix + MANIFEST
    ]
    if not made:
        raise CopyError(f"no objects under s3://{store.bucket}/{prefix} to copy")
    store.put(prefix + MANIFEST, manifest_bytes(made), "application/json")
    return made


def _entry(store: ObjectStore, prefix: str, key: str) -> Entry:
    """An object's manifest entry, from reading it whole."""
    digest, size = hashlib.sha256(), 0
    for chunk in store.chunks(prefix + key):
        digest.update(chunk)
        size += len(chunk)
    return Entry(key, size, digest.hexdigest())


def _digest_of(store: ObjectStore, key: str) -> str | None:
    try:
        return _entry(store, "", key).sha256
    except ObjectMissing:
        return None


@dataclass
class CopyReport:
    copied_bytes: int  # fetched from the source (refetches included)
    kept_bytes: int  # already in the target and verified (a resumed copy)
    total_bytes: int
    refetched: list[str]  # objects fetched again after a digest mismatch
    elapsed_s: float  # from the first byte fetched

    @property
    def rate_bps(self) -> float:
        return self.copied_bytes * 8 / self.elapsed_s if self.elapsed_s else 0.0


def copy_dataset(
    source: ObjectStore,
    target: ObjectStore,
    prefix: str,
    rate_bytes_per_s: float,
    stop: threading.Event,
    progress: Progress | None = None,
    mask: Mask | None = None,
) -> CopyReport | None:
    """Copy the dataset under `prefix` from `source` to `target` (its records' sensitive
    fields masked with `mask`); None when stopped first."""
    entries = manifest_of(source, prefix)
    target.ensure_bucket()
    total = sum(e.size for e in entries)
    pace = Throttle(rate_bytes_per_s)
    done = copied = kept = 0
    refetched: list[str] = []
    written: list[Entry] = []  # the target's manifest: what it holds (masked, if masked)
    present = {k[len(prefix) :] for k in target.keys(prefix)}
    for entry in entries:
        if stop.is_set():
            return None
        key = prefix + entry.key
        # (A masked copy is fetched whole again: what it should hold is known from the source.)
        if mask is None and entry.key in present and target.size(key) == entry.size:
            if _digest_of(target, key) == entry.sha256:
                done += entry.size
                kept += entry.size
                written.append(entry)
                if progress:
                    progress(done, total)
                continue
            refetched.append(entry.key)  # torn or tampered: fetched again
        for fetch in range(1, FETCHES + 1):
            data = _fetch(source, key, pace, stop)
            if data is None:
                return None
            copied += len(data)
            arrived = hashlib.sha256(data).hexdigest() if len(data) == entry.size else None
            if arrived == entry.sha256:
                body = data if mask is None else mask.apply(key, data)
                stored = Entry(entry.key, len(body), hashlib.sha256(body).hexdigest())
                target.put(key, body)
                if _digest_of(target, key) == stored.sha256:
                    written.append(stored)
                    break
            if fetch == FETCHES:
                raise CopyError(
                    f"{key}: its digest did not match the manifest after {FETCHES} fetches "
                    f"(sha256 {entry.sha256[:12]}...); the replica is not marked ready"
                )
            refetched.append(entry.key)
        done += entry.size
        if progress:
            progress(done, total)
    target.put(prefix + MANIFEST, manifest_bytes(written), "application/json")
    return CopyReport(copied, kept, total, refetched, pace.elapsed_s)


def _fetch(source: ObjectStore, key: str, pace: Throttle, stop: threading.Event) -> bytes | None:
    parts = []
    for chunk in source.chunks(key, CHUNK):
        pace.take(len(chunk), stop)
        if stop.is_set():
            return None
        parts.append(chunk)
    return b"".join(parts)
