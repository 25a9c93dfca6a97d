"""The built-in trainer (`fleetline workload train`) when its checkpoint store cannot be reached:
the store is the workload's port, scripted here to fail."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from fleetline.agents.workloads import train
from fleetline.errors import TransientStorageError


class Store:
    """A checkpoint store whose saves fail at the steps named."""

    prefix = "checkpoints/acme/cut"
    skipped = 0

    def __init__(self, failing: set[int]) -> None:
        self.failing = failing
        self.saved: list[int] = []

    def latest(self) -> None:
        return None

    def save(self, epoch, step, parts, meta):
        if step in self.failing:
            raise TransientStorageError("S3 at 10.78.0.1:27000: connect timed out")
        self.saved.append(step)
        return SimpleNamespace(name=f"step-{step}", bytes=1), 0.001


def run(tmp_path, monkeypatch, store: Store) -> tuple[int, list[dict]]:
    monkeypatch.setattr(train, "checkpoints_from_env", lambda env: store)
    progress = tmp_path / "progress.jsonl"
    env = {
        "FLEETLINE_STEPS": "6",
        "FLEETLINE_CHECKPOINT_EVERY": "2",
        "FLEETLINE_REPORT_EVERY": "1",
        "FLEETLINE_RESUME_CHECKPOINT": "",
        "FLEETLINE_PROGRESS_FILE": str(progress),
        "FLEETLINE_CHECKPOINT_BUCKET": "fleetline-eu-west-a",
    }
    code = train.main(env)
    return code, [json.loads(line) for line in progress.read_text().splitlines()]


def test_a_periodic_checkpoint_that_cannot_be_written_is_reported_and_training_goes_on(
    tmp_path, monkeypatch
) -> None:
    store = Store(failing={2})
    code, lines = run(tmp_path, monkeypatch, store)
    assert code == 0
    assert store.saved == [4, 6]
    failed = [line for line in lines if line["event"] == "checkpoint_failed"]
    assert [(f["step"], "connect timed out" in f["error"]) for f in failed] == [(2, True)]
    assert [line["step"] for line in lines if line["event"] == "progress"] == [1, 2, 3, 4, 5, 6]
    assert lines[-1]["event"] == "done"


def test_the_last_checkpoint_that_cannot_be_written_fails_the_workload(
    tmp_path, monkeypatch
) -> None:
    store = Store(failing={6})
    with pytest.raises(TransientStorageError):
        run(tmp_path, monkeypatch, store)
    assert store.saved == [2, 4]
