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


class Clock:
    """The trainer's clock, moved 10 s by each step's pause (its step delay)."""

    def __init__(self) -> None:
        self.now = 0.0

    def sleep(self, seconds: float) -> None:
        self.now += 10.0

    def monotonic(self) -> float:
        return self.now

    perf_counter = time = monotonic


def test_a_tuned_interval_in_the_control_file_is_taken_at_the_next_checkpoint(
    tmp_path, monkeypatch
) -> None:
    control = tmp_path / "control.json"
    control.write_text(json.dumps({"checkpoint_interval_s": 30}))

    class Retold(Store):
        def save(self, epoch, step, parts, meta):
            if step == 4:  # the cluster agent rewrites the file while the step-4 save runs
                control.write_text(json.dumps({"checkpoint_interval_s": 50}))
            return super().save(epoch, step, parts, meta)

    store = Retold(failing=set())
    monkeypatch.setattr(train, "checkpoints_from_env", lambda env: store)
    monkeypatch.setattr(train, "time", Clock())
    progress = tmp_path / "progress.jsonl"
    env = {
        "FLEETLINE_STEPS": "12",
        "FLEETLINE_CHECKPOINT_EVERY": "100",  # steps alone would checkpoint only at the end
        "FLEETLINE_STEP_DELAY_MS": "1",
        "FLEETLINE_RESUME_CHECKPOINT": "",
        "FLEETLINE_PROGRESS_FILE": str(progress),
        "FLEETLINE_CONTROL_FILE": str(control),
        "FLEETLINE_CHECKPOINT_BUCKET": "fleetline-eu-west-a",
    }
    assert train.main(env) == 0
    lines = [json.loads(line) for line in progress.read_text().splitlines()]
    # 10 s a step: every 30 s (step 4), then every 50 s from that checkpoint on (step 9), and
    # the last step's.
    assert store.saved == [4, 9, 12]
    tuned = [line for line in lines if line["event"] == "tuned"]
    assert [(t["step"], t["checkpoint_interval_s"], t["previous"]) for t in tuned] == [
        (4, 50.0, 30.0)
    ]


def test_without_a_control_file_checkpoints_follow_the_steps_alone(tmp_path, monkeypatch) -> None:
    store = Store(failing=set())
    monkeypatch.setattr(train, "time", Clock())
    code, lines = run(tmp_path, monkeypatch, store)
    assert code == 0 and store.saved == [2, 4, 6]
    assert not [line for line in lines if line["event"] == "tuned"]
