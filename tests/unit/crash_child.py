"""Run by test_crash_reports.py in a pytest of its own (not collected by the suite): a test
that opens a chdb store and then crashes the process."""

from __future__ import annotations

import ctypes

from fleetline.storage.clickhouse import connect


def test_crashes_after_opening_a_store(tmp_path):
    connect(f"chdb://{tmp_path}").command("SELECT 1")
    ctypes.string_at(0)  # reads address 0: SIGSEGV
