"""The agent's on-disk spool (no services)."""

from __future__ import annotations

from pathlib import Path

import pytest

from fleetline.agents.spool import DiskSpool, SpoolError


def fill(spool: DiskSpool, n: int, start: int = 0, size: int = 100) -> None:
    for i in range(start, start + n):
        spool.append("t", f"node-{i % 3}".encode(), i.to_bytes(4, "big") * (size // 4))


def test_entries_come_back_in_order_after_a_reopen(tmp_path: Path) -> None:
    spool = DiskSpool(tmp_path, segment_bytes=1000)
    fill(spool, 30)
    spool.ack(9)
    spool.close()
    reopened = DiskSpool(tmp_path, segment_bytes=1000)
    entries = reopened.unacked()
    assert [e.offset for e in entries] == list(range(10, 30))
    assert entries[0].key == b"node-1" and entries[0].value[:4] == (10).to_bytes(4, "big")
    fill(reopened, 1, start=30)
    assert reopened.unacked()[-1].offset == 30


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
    offsets = [e.offset for e in spool.unacked()]
    assert offsets == list(range(offsets[0], 200))  # the newest, contiguous
    assert spool.acked == offsets[0] - 1


def test_a_torn_last_entry_is_cut_off(tmp_path: Path) -> None:
    spool = DiskSpool(tmp_path)
    fill(spool, 5)
    spool.close()
    segment = next(tmp_path.glob("*.seg"))
    segment.write_bytes(segment.read_bytes()[:-7])
    reopened = DiskSpool(tmp_path)
    assert [e.offset for e in reopened.unacked()] == [0, 1, 2, 3]
    assert reopened.corrupt_tail == 1
    fill(reopened, 1, start=4)
    assert DiskSpool(tmp_path).unacked()[-1].offset == 4


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
