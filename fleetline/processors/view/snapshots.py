"""The view's snapshots: each part encoded by the view codec, kept as blobs in object storage.

A snapshot is a cache of a part's fold plus the offsets it stands at: a restarted instance loads
the newest one of each part it is given and resumes right after it; a replay starts from the
newest one at or before its target.
"""

from __future__ import annotations

from collections.abc import Mapping

from fleetline.errors import IntegrityError
from fleetline.processors.view import codec as view_codec
from fleetline.processors.view.model import ResourceView
from fleetline.storage.snapshots import SnapshotInfo, SnapshotStore


class ViewSnapshots:
    def __init__(self, blobs: SnapshotStore) -> None:
        self.blobs = blobs

    def save(self, part: str, view: ResourceView) -> SnapshotInfo:
        blob, sha256 = view_codec.encode(view)
        return self.blobs.save(part, blob, sha256, view.offsets, view.version, view.watermark_ms)

    def list(self, part: str) -> list[SnapshotInfo]:
        return self.blobs.list(part)

    def latest(
        self, part: str, within: Mapping[str, Mapping[int, int]] | None = None
    ) -> SnapshotInfo | None:
        return self.blobs.latest(part, within)

    def load(self, info: SnapshotInfo) -> ResourceView:
        view = view_codec.decode(self.blobs.load(info), info.sha256)
        if view.offsets != info.offsets:
            raise IntegrityError(f"snapshot {info.blob_key}: offsets differ from its manifest")
        return view
