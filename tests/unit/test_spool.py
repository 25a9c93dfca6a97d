"""The agent's on-disk spool (no services)."""

from __future__ import annotations

from pathlib import Path

import pytest

from fleetline.agents.spool import DiskSpool, SpoolError
from fleetline.storage.crypto import ObjectCipher


def fill(spool: DiskSpool, n: int, start: int = 0, size: int = 100) -> None:
    for i in range(start, start + n):
        spool.append("t", f"node-{i % 3}".encode(), i.to_bytes(4, "big") * (size // 4))


def test_entries_come_back_in_order_after_a_reopen(tmp_path: Path) -> None:
    spool = DiskSpool(tmp_path, segment_bytes=1000)
    fill(spool, 30)
    spool.ack(9)
    spool.close()
    reopened = DiskSpool(tmp_path, segment_bytes=1000)
    entries = list(reopened.entries_from(0))
    assert [e.offset for e in entries] == list(range(10, 30))
    assert entries[0].key == b"node-1" and entries[0].value[:4] == (10).to_bytes(4, "big")
    fill(reopened, 1, start=30)
    assert list(reopened.entries_from(0))[-1].offset == 30


def test_acknowledged_segments_are_deleted(tmp_path: Path) -> None:
    spool = DiskSpool(tmp_path, segment_bytes=1000)
    fill(spool, 40)
    before = len(list(tmp_path.glob("*.seg")))
    spool.ack(39)
    assert len(spool) == 0
    assert len(list(tmp_path.glob("*.seg"))) == 1 < before


def test_the_bound_drops_the_oldest_and_counts_them(tmp_path: Path) -> None:
    spool = DiskSpool(tmp_path, max_bytes=5000, segment_bytes=1000)
    fill(spool, 200)
    assert spool.size_bytes <= 5000
    assert spool.dropped > 0
    assert spool.dropped + len(spool) == 200
    offsets = [e.offset for e in spool.entries_from(0)]
    assert offsets == list(range(offsets[0], 200))  # the newest, contiguous
    assert spool.acked == offsets[0] - 1


def test_a_torn_last_entry_is_cut_off(tmp_path: Path) -> None:
    spool = DiskSpool(tmp_path)
    fill(spool, 5)
    spool.close()
    segment = next(tmp_path.glob("*.seg"))
    segment.write_bytes(segment.read_bytes()[:-7])
    reopened = DiskSpool(tmp_path)
    assert [e.offset for e in reopened.entries_from(0)] == [0, 1, 2, 3]
    assert reopened.corrupt_tail == 1
    fill(reopened, 1, start=4)
    assert list(DiskSpool(tmp_path).entries_from(0))[-1].offset == 4


def test_entries_from_reads_the_tail(tmp_path: Path) -> None:
    spool = DiskSpool(tmp_path)
    fill(spool, 10)
    spool.ack(3)
    assert [e.offset for e in spool.entries_from(7)] == [7, 8, 9]
    assert [e.offset for e in spool.entries_from(0)] == list(range(4, 10))


def test_bad_settings_are_refused(tmp_path: Path) -> None:
    with pytest.raises(SpoolError, match="exceeds max_bytes"):
        DiskSpool(tmp_path, max_bytes=10, segment_bytes=100)
    (tmp_path / "file").write_text("x")
    with pytest.raises(SpoolError, match="spool folder"):
        DiskSpool(tmp_path / "file" / "sub")


def test_a_full_disk_keeps_records_in_memory_and_writing_resumes_in_a_new_segment(
    tmp_path: Path,
) -> None:
    # The next segment's file is /dev/full: every write to it fails with ENOSPC, as on a disk
    # with no room left (a real small filesystem is in tests/chaos/test_spool_disk_full.py).
    spool = DiskSpool(tmp_path, segment_bytes=1000)
    fill(spool, 8)  # frames of 119 bytes: 8 fill the first segment, the 9th begins another
    (tmp_path / f"{8:020d}.seg").symlink_to("/dev/full")
    fill(spool, 64, start=8)
    assert spool.disk_full and spool.unspooled == 64
    assert [e.offset for e in spool.entries_from(0)] == list(range(72))  # still sent from memory
    assert not (tmp_path / f"{8:020d}.seg").exists()  # the segment it could not write
    fill(spool, 5, start=72)  # the 64th failure tried again: room now
    assert not spool.disk_full and spool.unspooled == 64
    assert (tmp_path / f"{72:020d}.seg").exists()
    spool.ack(40)  # Kafka has the first 41 (most of them never on disk)
    spool.close()
    reopened = DiskSpool(tmp_path, segment_bytes=1000)
    # What was on disk and not acknowledged comes back; the memory-only records between are
    # gone with the process unless acknowledged (41-71 were not: `unspooled` counted them).
    assert [e.offset for e in reopened.entries_from(0)] == list(range(72, 77))
    assert reopened.corrupt_tail == 0
    fill(reopened, 1, start=77)
    assert list(reopened.entries_from(0))[-1].offset == 77


def test_a_write_torn_by_a_full_disk_is_cut_off(tmp_path: Path, monkeypatch) -> None:
    import errno

    spool = DiskSpool(tmp_path, segment_bytes=10_000)
    fill(spool, 3)
    writer = spool._writer
    assert writer is not None
    real_write = writer.write
    calls = {"n": 0}

    def half_then_full(data):  # the disk fills in the middle of a frame
        calls["n"] += 1
        if calls["n"] == 1:
            return real_write(bytes(data)[:50])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(writer, "write", half_then_full, raising=False)
    fill(spool, 1, start=3)
    assert spool.disk_full and spool.unspooled == 1
    assert (tmp_path / f"{0:020d}.seg").stat().st_size == 3 * 119  # the torn half is gone
    spool.close()
    assert [e.offset for e in DiskSpool(tmp_path).entries_from(0)] == [0, 1, 2]


def test_a_sealed_spool_holds_no_plaintext_and_opens_only_with_its_key(tmp_path: Path) -> None:
    key, other = bytes(range(32)), bytes(32)
    secret = b'{"node":"gpu-17","model":"H100","serial":"SN-4711"}'
    spool = DiskSpool(tmp_path, cipher=ObjectCipher(key))
    for i in range(5):
        spool.append("telemetry", f"gpu-{i}".encode(), secret)
    spool.ack(1)
    spool.close()
    on_disk = b"".join(p.read_bytes() for p in tmp_path.glob("*.seg"))
    assert on_disk and b"SN-4711" not in on_disk and b"telemetry" not in on_disk
    assert b"gpu-3" not in on_disk
    reopened = DiskSpool(tmp_path, cipher=ObjectCipher(key))
    entries = list(reopened.entries_from(0))
    assert [(e.offset, e.topic, e.key, e.value) for e in entries] == [
        (i, "telemetry", f"gpu-{i}".encode(), secret) for i in range(2, 5)
    ]
    reopened.close()
    # Without the key, or with another, the agent is refused (naming the folder); nothing is
    # dropped, so with the right key everything is still there.
    with pytest.raises(SpoolError, match="is sealed: the agent needs the key"):
        DiskSpool(tmp_path)
    with pytest.raises(SpoolError, match="entry 2 does not open with this key"):
        DiskSpool(tmp_path, cipher=ObjectCipher(other))
    assert len(DiskSpool(tmp_path, cipher=ObjectCipher(key))) == 3


def test_an_entry_moved_within_a_sealed_spool_does_not_open(tmp_path: Path) -> None:
    cipher = ObjectCipher(bytes(range(32)))
    spool = DiskSpool(tmp_path, cipher=cipher)
    spool.append("t", b"a", b"first")
    spool.append("t", b"b", b"second")
    spool.close()
    segment = next(tmp_path.glob("*.seg"))
    data = segment.read_bytes()
    length = int.from_bytes(data[:4], "little")
    first, second = data[: 8 + length], data[8 + length :]
    segment.write_bytes(second + first)  # each entry now sits at the other's offset
    with pytest.raises(SpoolError, match="entry 0 does not open"):
        DiskSpool(tmp_path, cipher=cipher)


def test_a_clear_spool_from_before_sealing_is_still_read_and_sent(tmp_path: Path) -> None:
    fill(DiskSpool(tmp_path), 3)
    sealed = DiskSpool(tmp_path, cipher=ObjectCipher(bytes(range(32))))
    fill(sealed, 2, start=3)
    sealed.close()
    offsets = [e.offset for e in DiskSpool(tmp_path, cipher=sealed.cipher).entries_from(0)]
    assert offsets == [0, 1, 2, 3, 4]
