"""View snapshots: a cache of the fold plus the offsets it stands at, kept in object storage.

Each snapshot is two objects under `<root>/<part>/`: the gzipped view, then a small JSON manifest
naming its offsets and checksum. The manifest is written last and is what makes a snapshot
exist, so a crash between the two leaves an orphan blob that nothing reads. Keys sort by the
part's position in the log (the sum of its offsets, which only grows), so the newest is last.
"""

from __future__ import annotations

import contextlib
import json
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass

from fleetline.errors import IntegrityError, StorageError
from fleetline.processors.view import codec as view_codec
from fleetline.processors.view.fold import ResourceView
from fleetline.storage.objects import ObjectStore

Offsets = Mapping[str, Mapping[int, int]]


@dataclass(frozen=True)
class SnapshotInfo:
    part: str
    position: int
    offsets: dict[str, dict[int, int]]
    sha256: str
    blob_key: str
    version: int
    watermark_ms: int


def _position(offsets: Offsets) -> int:
    return sum(sum(parts.values()) for parts in offsets.values())


def _stem(key: str) -> str:
    """`<root>/<part>/<position>-<sha>` of a snapshot object's key (roots may contain dots)."""
    return key[:key.index(".", key.rindex("/"))]


def covers(limit: Offsets, offsets: Offsets) -> bool:
    """True when `offsets` does not go past `limit` in any partition (missing in limit = 0)."""
    return all(offset <= limit.get(topic, {}).get(partition, 0)
               for topic, parts in offsets.items() for partition, offset in parts.items())


class ViewSnapshots(ABC):
    """The port: store a part's view, find the newest one at or before some offsets."""

    @abstractmethod
    def save(self, part: str, view: ResourceView) -> SnapshotInfo: ...

    @abstractmethod
    def list(self, part: str) -> list[SnapshotInfo]: ...

    @abstractmethod
    def load(self, info: SnapshotInfo) -> ResourceView: ...

    def latest(self, part: str, within: Offsets | None = None) -> SnapshotInfo | None:
        """The newest snapshot of `part`, or the newest whose offsets are all within `within`."""
        for info in reversed(self.list(part)):
            if within is None or covers(within, info.offsets):
                return info
        return None


class S3ViewSnapshots(ViewSnapshots):
    def __init__(self, store: ObjectStore, root: str, keep: int = 100) -> None:
        self.store = store
        self.root = root.strip("/")
        self.keep = keep

    def _prefix(self, part: str) -> str:
        return f"{self.root}/{part}/"

    def save(self, part: str, view: ResourceView) -> SnapshotInfo:
        blob, sha256 = view_codec.encode(view)
        offsets = {t: dict(ps) for t, ps in view.offsets.items()}
        position = _position(offsets)
        stem = f"{self._prefix(part)}{position:020d}-{sha256[:12]}"
        info = SnapshotInfo(part, position, offsets, sha256, f"{stem}.view.json.gz",
                            view.version, view.watermark_ms)
        self.store.put(info.blob_key, blob, "application/gzip")
        manifest = {"part": part, "position": position, "sha256": sha256,
                    "blob_key": info.blob_key, "version": view.version,
                    "watermark_ms": view.watermark_ms,
                    "offsets": {t: {str(p): o for p, o in ps.items()}
                                for t, ps in offsets.items()}}
        self.store.put(f"{stem}.manifest.json", json.dumps(manifest, sort_keys=True).encode(),
                       "application/json")
        self._prune(part)
        return info

    def list(self, part: str) -> list[SnapshotInfo]:
        out = []
        for key in self.store.keys(self._prefix(part)):
            if not key.endswith(".manifest.json"):
                continue
            try:
                m = json.loads(self.store.get(key))
                out.append(SnapshotInfo(
                    part=m["part"], position=m["position"], sha256=m["sha256"],
                    blob_key=m["blob_key"], version=m["version"],
                    watermark_ms=m["watermark_ms"],
                    offsets={t: {int(p): o for p, o in ps.items()}
                             for t, ps in m["offsets"].items()}))
            except (ValueError, KeyError, TypeError) as exc:
                raise IntegrityError(f"snapshot manifest {key} is malformed: {exc}") from None
        return sorted(out, key=lambda info: (info.position, info.blob_key))

    def load(self, info: SnapshotInfo) -> ResourceView:
        view = view_codec.decode(self.store.get(info.blob_key), info.sha256)
        if view.offsets != info.offsets:
            raise IntegrityError(f"snapshot {info.blob_key}: offsets differ from its manifest")
        return view

    def _prune(self, part: str) -> None:
        keys = self.store.keys(self._prefix(part))
        stems = sorted({_stem(k) for k in keys if k.endswith(".manifest.json")})
        doomed = set(stems[:-self.keep]) if len(stems) > self.keep else set()
        for key in keys:
            stem = _stem(key)
            # Orphan blobs (no manifest: a crash between the two writes) older than the newest
            # manifest are dead too.
            orphan = key.endswith(".view.json.gz") and stem not in stems and stems \
                and stem < stems[-1]
            if stem in doomed or orphan:
                # Pruning is housekeeping; the next save tries again.
                with contextlib.suppress(StorageError):
                    self.store.delete(key)
