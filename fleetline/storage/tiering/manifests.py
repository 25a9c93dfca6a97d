"""The manifests this process has read, kept while the bucket lists them with the same ETag: a
manifest is written whole and rewritten only under a new ETag (a purge), so a query's store
(one a query) lists the bucket once instead of reading every manifest again."""

from __future__ import annotations

import threading
from collections.abc import Mapping

from fleetline.errors import ObjectMissing
from fleetline.storage.objects import ObjectStore
from fleetline.storage.tiering.policy import Manifest

# bucket/key -> (its ETag when read, the manifest)
_READ: dict[str, tuple[str, Manifest]] = {}
_LOCK = threading.Lock()


def read_manifests(objects: ObjectStore, prefix: str, listed: Mapping[str, str]) -> list[Manifest]:
    """The manifests `listed` (key -> ETag) under `prefix`, read from the bucket only where this
    process has not read that version yet; one that went since the listing (another pass
    uncommitted it) is left out, and so are the forgotten ones of the prefix."""
    found: list[Manifest] = []
    for key, etag in sorted(listed.items()):
        if not key.endswith(".json"):
            continue
        where = f"{objects.bucket}/{key}"
        with _LOCK:
            cached = _READ.get(where)
        if cached is not None and etag and cached[0] == etag:
            found.append(cached[1])
            continue
        try:
            manifest = Manifest.from_json(objects.get(key))
        except ObjectMissing:
            continue
        with _LOCK:
            _READ[where] = (etag, manifest)
        found.append(manifest)
    gone = f"{objects.bucket}/{prefix}"
    with _LOCK:
        for where in [w for w in _READ if w.startswith(gone)]:
            if where[len(objects.bucket) + 1 :] not in listed:
                del _READ[where]
    return found
