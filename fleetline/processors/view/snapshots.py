"""The view's snapshots: each part encoded by the view codec, kept as blobs in object storage.

A snapshot is a cache of a part's fold plus the offsets it stands at: a restarted instance loads
the newest one of each part it is given and resumes right after it; a replay starts from the
newest one at or before its target.
"""

from __future__ import annotations

import builtins
from collections.abc import Mapping

from fleetline.errors import IntegrityError, ObjectMissing
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

    def load_newest(
        self, part: str, within: Mapping[str, Mapping[int, int]] | None = None
    ) -> tuple[SnapshotInfo | None, ResourceView | None, tuple[str, ...]]:
        """The newest snapshot of `part` (within `within`) that can still be read, and a note for
        each newer one passed over (pruned by the live process between listing and reading, or
        refused: altered, or sealed under another key); (None, None, notes) when none is left,
        so the caller folds the part from the log. A snapshot is a cache: the log is the truth."""
        notes: builtins.list[str] = []
        for info in self.blobs.newest_first(part, within):
            try:
                return info, self.load(info), tuple(notes)
            except ObjectMissing:
                notes.append(
                    f"{part}: the snapshot at position {info.position} was pruned while it was "
                    "read; using an older one"
                )
            except IntegrityError as exc:
                notes.append(
                    f"{part}: the snapshot at position {info.position} was refused ({exc}); "
                    "using an older one"
                )
        if notes:
            notes.append(f"{part}: no snapshot left to read; folding it from the log")
        return None, None, tuple(notes)

    def load(self, info: SnapshotInfo) -> ResourceView:
        view = view_codec.decode(self.blobs.load(info), info.sha256)
        if view.offsets != info.offsets:
            raise IntegrityError(f"snapshot {info.blob_key}: offsets differ from its manifest")
        return view
