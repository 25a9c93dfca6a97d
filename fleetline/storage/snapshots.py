"""Snapshot blobs in object storage: a cache of a fold plus the offsets it stands at.

Each snapshot is two objects under `<root>/<part>/`: the blob (a fold's state, encoded by its
owner), then a small JSON manifest naming its offsets and checksum. The manifest is written
last and is what makes a snapshot exist, so a crash between the two leaves an orphan blob that
nothing reads. Keys sort by the part's position in the log (the sum of its offsets, which only
grows), so the newest is last. This adapter knows nothing of what the blob holds.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from fleetline.errors import IntegrityError, ObjectMissing, StorageError
from fleetline.storage.objects import Objects
from fleetline.streams.records import Offsets, copy_offsets, position

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SnapshotInfo:
    part: str
    position: int
    offsets: Offsets
    sha256: str
    blob_key: str
    version: int
    watermark_ms: int


def _stem(key: str) -> str:
    """`<root>/<part>/<position>-<sha>` of a snapshot object's key (roots may contain dots)."""
    return key[: key.index(".", key.rindex("/"))]


def covers(limit: Mapping[str, Mapping[int, int]], offsets: Offsets) -> bool:
    """True when `offsets` does not go past `limit` in any partition (missing in limit = 0)."""
    return all(
        offset <= limit.get(topic, {}).get(partition, 0)
        for topic, parts in offsets.items()
        for partition, offset in parts.items()
    )


class SnapshotStore:
    """Snapshots of the parts of one fold, under `root` in a bucket."""

    def __init__(
        self, store: Objects, root: str, keep: int = 100, suffix: str = ".view.json.gz"
    ) -> None:
        self.store = store
        self.root = root.strip("/")
        self.keep = keep
        self.suffix = suffix  # of the blobs' keys: what their owner encodes them as

    def _prefix(self, part: str) -> str:
        return f"{self.root}/{part}/"

    def save(
        self, part: str, blob: bytes, sha256: str, offsets: Offsets, version: int, watermark_ms: int
    ) -> SnapshotInfo:
        offsets = copy_offsets(offsets)
        at = position(offsets)
        stem = f"{self._prefix(part)}{at:020d}-{sha256[:12]}"
        info = SnapshotInfo(
            part, at, offsets, sha256, f"{stem}{self.suffix}", version, watermark_ms
        )
        self.store.put(info.blob_key, blob, "application/gzip")
        manifest = {
            "part": part,
            "position": at,
            "sha256": sha256,
            "blob_key": info.blob_key,
            "version": version,
            "watermark_ms": watermark_ms,
            "offsets": {t: {str(p): o for p, o in ps.items()} for t, ps in offsets.items()},
        }
        self.store.put(
            f"{stem}.manifest.json",
            json.dumps(manifest, sort_keys=True).encode(),
            "application/json",
        )
        self._prune(part)
        return info

    def list(self, part: str) -> list[SnapshotInfo]:
        out = []
        for key in self.store.keys(self._prefix(part)):
            if not key.endswith(".manifest.json"):
                continue
            try:
                m = json.loads(self.store.get(key))
            except ObjectMissing:
                continue  # pruned by the live process since it was listed: no longer a snapshot
            except (IntegrityError, ValueError) as exc:
                # Sealed under another key, sealed and read with none (ciphertext is not JSON),
                # or written before sealing was configured: a cache entry this reader cannot
                # use; the log rebuilds what it held.
                log.warning("snapshot manifest %s skipped: %s", key, exc)
                continue
            try:
                out.append(
                    SnapshotInfo(
                        part=m["part"],
                        position=m["position"],
                        sha256=m["sha256"],
                        blob_key=m["blob_key"],
                        version=m["version"],
                        watermark_ms=m["watermark_ms"],
                        offsets={
                            t: {int(p): o for p, o in ps.items()} for t, ps in m["offsets"].items()
                        },
                    )
                )
            except (ValueError, KeyError, TypeError) as exc:
                raise IntegrityError(f"snapshot manifest {key} is malformed: {exc}") from None
        return sorted(out, key=lambda info: (info.position, info.blob_key))

    def latest(
        self, part: str, within: Mapping[str, Mapping[int, int]] | None = None
    ) -> SnapshotInfo | None:
        """The newest snapshot of `part`, or the newest whose offsets are all within `within`."""
        return next(self.newest_first(part, within), None)

    def newest_first(
        self, part: str, within: Mapping[str, Mapping[int, int]] | None = None
    ) -> Iterator[SnapshotInfo]:
        """The snapshots of `part` (those within `within`), newest first: a reader whose pick is
        pruned before it is read (`load` raises ObjectMissing) goes on to the next."""
        for info in reversed(self.list(part)):
            if within is None or covers(within, info.offsets):
                yield info

    def load(self, info: SnapshotInfo) -> bytes:
        return self.store.get(info.blob_key)

    def _prune(self, part: str) -> None:
        keys = self.store.keys(self._prefix(part))
        stems = sorted({_stem(k) for k in keys if k.endswith(".manifest.json")})
        doomed = set(stems[: -self.keep]) if len(stems) > self.keep else set()
        for key in keys:
            stem = _stem(key)
            # Orphan blobs (no manifest: a crash between the two writes) older than the newest
            # manifest are dead too.
            orphan = key.endswith(self.suffix) and stem not in stems and stems and stem < stems[-1]
            if stem in doomed or orphan:
                # Pruning is housekeeping; the next save tries again.
                with contextlib.suppress(StorageError):
                    self.store.delete(key)
