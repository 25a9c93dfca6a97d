"""A bounded on-disk spool: every record the agent emits is appended here before it is sent.

Records are kept in segment files (`<first offset>.seg`, entries framed as length + CRC32 +
payload) and an `acked` file says how far Kafka has acknowledged. After a broker outage or an
agent restart the unacknowledged tail is sent again, in order. When the spool outgrows its bound
the oldest segment is deleted, acknowledged or not, and the records lost that way are counted:
the agent never blocks collection and never grows without bound.

A full disk (or quota) does not stop the agent either: a record that cannot be written is kept in
memory only (counted in `unspooled`; it is still sent and acknowledged, and lost only if the
agent dies before that), a torn frame is cut off, and writing resumes in a new segment starting
at its own offset once a later attempt finds room, so offsets on disk stay consistent.

With the deployment key (FLEETLINE_OBJECT_ENCRYPTION_KEY) each entry is sealed on disk
(AES-256-GCM, storage/crypto.py) with its offset as associated data, so the node's disk holds
no telemetry in clear and an entry moved to another place in the spool fails to open. A spool
written in clear before sealing was turned on is still read (and sent); a sealed one opened
without its key is refused, naming the folder, rather than dropped.
"""

from __future__ import annotations

import itertools
import os
import struct
import zlib
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from fleetline.agents.durable import DISK_FULL, write_if_room
from fleetline.errors import FleetlineError, IntegrityError
from fleetline.storage.crypto import MAGIC, ObjectCipher

_FRAME = struct.Struct("<II")  # payload length, CRC32 of payload
# While the disk is full, one append in this many tries the disk again (the rest go straight to
# memory: a failing write costs a system call and a truncation).
RETRY_DISK_EVERY = 64
_STRINGS = struct.Struct("<HH")  # topic length, key length


class SpoolError(FleetlineError):
    """The spool folder cannot be used."""


@dataclass(frozen=True)
class SpoolEntry:
    offset: int
    topic: str
    key: bytes
    value: bytes

    def encode(self, cipher: ObjectCipher | None = None) -> bytes:
        topic = self.topic.encode()
        payload = _STRINGS.pack(len(topic), len(self.key)) + topic + self.key + self.value
        if cipher is not None:
            payload = cipher.seal(_sealed_as(self.offset), payload)
        return _FRAME.pack(len(payload), zlib.crc32(payload)) + payload


def _sealed_as(offset: int) -> str:
    return f"spool/{offset}"


def _decode(offset: int, payload: bytes, cipher: ObjectCipher | None, where: Path) -> SpoolEntry:
    # A clear entry starts with its topic's length (a few dozen), never with the seal's magic.
    if payload.startswith(MAGIC):
        if cipher is None:
            raise SpoolError(
                f"spool folder {where} is sealed: the agent needs the key it was sealed with "
                "(FLEETLINE_OBJECT_ENCRYPTION_KEY)"
            )
        try:
            payload = cipher.open(_sealed_as(offset), payload)
        except IntegrityError:
            raise SpoolError(
                f"spool folder {where}: entry {offset} does not open with this key (sealed "
                "under another key, or altered); nothing was dropped"
            ) from None
    topic_len, key_len = _STRINGS.unpack_from(payload)
    start = _STRINGS.size
    topic = payload[start : start + topic_len].decode()
    key = payload[start + topic_len : start + topic_len + key_len]
    return SpoolEntry(offset, topic, key, payload[start + topic_len + key_len :])


class DiskSpool:
    def __init__(
        self,
        directory: Path,
        max_bytes: int = 256 * 2**20,
        segment_bytes: int = 8 * 2**20,
        fsync: bool = False,
        cipher: ObjectCipher | None = None,
    ) -> None:
        if segment_bytes > max_bytes:
            raise SpoolError(f"segment_bytes {segment_bytes} exceeds max_bytes {max_bytes}")
        self.directory = directory
        self.max_bytes = max_bytes
        self.segment_bytes = segment_bytes
        self.fsync = fsync
        self.cipher = cipher
        self.dropped = 0  # records deleted unacknowledged because of the bound
        self.corrupt_tail = 0  # torn entries found at the end of a segment on open
        self.unspooled = 0  # records kept in memory only: the disk was full
        self.disk_full = False  # the last write found no room
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise SpoolError(f"spool folder {directory}: {exc}") from None
        self._acked_file = directory / "acked"
        self.acked = int(self._acked_file.read_text()) if self._acked_file.exists() else -1
        # (first offset, path, bytes) per segment, oldest first.
        self._segments: deque[tuple[int, Path, int]] = deque()
        self._unacked: deque[SpoolEntry] = deque()
        self.next_offset = self.acked + 1
        self._load()
        self._writer: BinaryIO | None = None

    def _load(self) -> None:
        for path in sorted(self.directory.glob("*.seg"), key=lambda p: int(p.stem)):
            first = int(path.stem)
            data = path.read_bytes()
            position, offset = 0, first
            while position + _FRAME.size <= len(data):
                length, crc = _FRAME.unpack_from(data, position)
                payload = data[position + _FRAME.size : position + _FRAME.size + length]
                if len(payload) < length or zlib.crc32(payload) != crc:
                    break
                if offset > self.acked:
                    self._unacked.append(_decode(offset, payload, self.cipher, self.directory))
                position += _FRAME.size + length
                offset += 1
            if position < len(data):
                # A crash mid-append leaves a torn last entry; cut it off so appends continue
                # from a clean boundary.
                self.corrupt_tail += 1
                with path.open("r+b") as handle:
                    handle.truncate(position)
            self._segments.append((first, path, position))
            self.next_offset = max(self.next_offset, offset)

    @property
    def size_bytes(self) -> int:
        return sum(size for _, _, size in self._segments)

    def __len__(self) -> int:
        return len(self._unacked)

    def append(self, topic: str, key: bytes, value: bytes) -> SpoolEntry:
        entry = SpoolEntry(self.next_offset, topic, key, value)
        if not self.disk_full or self.unspooled % RETRY_DISK_EVERY == 0:
            self.disk_full = not self._write(entry)
        if self.disk_full:
            self.unspooled += 1
        self._unacked.append(entry)
        self.next_offset += 1
        self._enforce_bound()
        return entry

    def _write(self, entry: SpoolEntry) -> bool:
        """Append the entry's frame to the newest segment (a new one when it is full or the
        last write failed); False when the disk has no room for it."""
        frame = entry.encode(self.cipher)
        rolled = False
        try:
            if (
                self.disk_full
                or not self._segments
                or self._segments[-1][2] + len(frame) > self.segment_bytes
            ):
                self._roll(entry.offset)
                rolled = True
            elif self._writer is None:  # reopened: continue the newest segment
                self._writer = self._segments[-1][1].open("ab", buffering=0)
            assert self._writer is not None
            view = memoryview(frame)
            while view:
                view = view[self._writer.write(view) or 0 :]
            if self.fsync:
                os.fsync(self._writer.fileno())
        except OSError as exc:
            if exc.errno not in DISK_FULL:
                raise SpoolError(f"spool folder {self.directory}: {exc}") from None
            self._give_up_segment(rolled)
            return False
        first, path, size = self._segments[-1]
        self._segments[-1] = (first, path, size + len(frame))
        return True

    def _give_up_segment(self, rolled: bool) -> None:
        """After a write found no room: cut the torn frame off (or drop the segment just begun),
        so the next write starts a new segment at its own offset."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if not self._segments:
            return
        _, path, size = self._segments[-1]
        if rolled or size == 0:
            self._segments.pop()
            path.unlink(missing_ok=True)
        else:
            with path.open("r+b") as handle:  # shrinking needs no room
                handle.truncate(size)

    def _roll(self, first: int) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        path = self.directory / f"{first:020d}.seg"
        self._segments.append((first, path, 0))
        self._writer = path.open("ab", buffering=0)

    def _enforce_bound(self) -> None:
        while self.size_bytes > self.max_bytes and len(self._segments) > 1:
            _, path, _ = self._segments.popleft()
            end = self._segments[0][0]  # first offset of the next segment
            lost = [e for e in self._unacked if e.offset < end]
            self.dropped += len(lost)
            for _ in lost:
                self._unacked.popleft()
            path.unlink(missing_ok=True)
            if self.acked < end - 1:
                self._set_acked(end - 1)

    def entries_from(self, offset: int) -> Iterator[SpoolEntry]:
        """Unacknowledged entries from `offset` on, oldest first."""
        if not self._unacked:
            return iter(())
        return itertools.islice(self._unacked, max(0, offset - self._unacked[0].offset), None)

    def ack(self, offset: int) -> None:
        """Everything up to and including `offset` is durable in Kafka."""
        if offset <= self.acked:
            return
        while self._unacked and self._unacked[0].offset <= offset:
            self._unacked.popleft()
        self._set_acked(offset)
        # Segments wholly acknowledged are no longer needed (keep the one being written).
        while len(self._segments) > 1 and self._segments[1][0] <= offset + 1:
            _, path, _ = self._segments.popleft()
            path.unlink(missing_ok=True)

    def _set_acked(self, offset: int) -> None:
        self.acked = offset
        try:
            # With the disk full the mark on disk stays behind: after a restart the agent
            # sends again what Kafka already has, which consumers drop by its seq.
            write_if_room(self._acked_file, str(offset))
        except OSError as exc:
            raise SpoolError(f"spool folder {self.directory}: {exc}") from None

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
