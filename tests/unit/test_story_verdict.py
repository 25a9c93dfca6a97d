"""Whether a played story happened as scripted (demo/verdict.py), and what each scenario needs
from the host before it starts (demo/scenario.Scenario.needs, infra/needs.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from fleetline.demo import scenario as scenarios
from fleetline.demo.play import SliceResult
from fleetline.demo.verdict import (
    SCRIPTED_API_CALLS,
    last_word,
    story_steps,
    summary_lines,
)
from fleetline.errors import EXIT_UNAVAILABLE
from fleetline.infra import needs

FAILED_TIDAL = {
    "key": "acme/tidal",
    "phase": "Failed",
    "conditions": {
        "Placed": {"reason": "us-east-a scores 54.876639 (cost 0.876639, ...)"},
        "Finished": {
            "reason": "us-east-a reports: attempt 3 failed with exit code 127: cannot start "
            "'mpirun': [Errno 2]; no retry left"
        },
    },
}


def told_loss(**changed: Any) -> dict[str, Any]:
    """The postmortem of the default story, as far as its step reads it."""
    return {
        "faults": [
            {
                "kind": "cluster_lost",
                "subject": "eu-west-a",
                "detected_ms": 3300,
                "detection_s": 3.3,
            }
        ],
        "impact": {
            "jobs": [{"job": "acme/story", "moves": [{"from": "eu-west-a", "recovery_s": 9.1}]}]
        },
        "audit": {"ok": True},
        **changed,
    }


def played(**parts: Any) -> SliceResult:
    """What `play` returns for the default story when everything happened."""
    base: dict[str, Any] = {
        "telemetry_sent": 1,
        "states_sent": 1,
        "malformed_sent": 1,
        "clusters": [],
        "unhealthy_gpus": [],
        "half_way_clusters": [],
        "half_way_replay": {},
        "processor_dead_letters": 1,
        "sink_rows": 8,
        "sink_dead_letters": 1,
        "query_rows": [],
        "snapshots": [],
        "api_calls": [(path, status) for path, _, status in SCRIPTED_API_CALLS],
        "audit": {"ok": True, "first_broken": None},
        "scheduling": {
            "failures": {},
            "audited": {"decisions": 3, "missing": [], "changed": []},
            "replay": {
                "ok": True,
                "matched": 3,
                "decisions": 3,
                "first_difference": None,
            },
        },
        "cluster_story": {
            "lost": "eu-west-a",
            "detected_s": 3.3,
            "fenced": True,
            "identical": True,
        },
        "serving_day": {
            "scaled": ["scale out to 2", "scale out to 3", "scale in to 1"],
            "load": {"requests": 1575, "failed": 0},
        },
        "postmortem": {"report": told_loss(), "files": {}},
    }
    base.update(parts)
    return SliceResult(**base)


def test_a_story_that_happened_says_so_in_its_last_line() -> None:
    steps = story_steps(played(), scenarios.load("default"))
    assert [s.happened for s in steps] == [True] * len(steps) and len(steps) == 8
    assert summary_lines(steps) == ["8 of 8 story steps as scripted"]


def test_a_job_that_exhausted_its_attempts_is_named_with_its_last_failure() -> None:
    scheduling = {
        **played().scheduling,
        "failures": {"acme/tidal": last_word(FAILED_TIDAL)},
    }
    day = {"skipped": "acme/tidal ended Failed before it ran: " + last_word(FAILED_TIDAL)}
    steps = story_steps(played(scheduling=scheduling, serving_day=day), scenarios.load("default"))
    lines = summary_lines(steps)
    assert lines[-1] == "6 of 8 story steps as scripted"
    assert lines[0] == (
        "NOT AS SCRIPTED: every job ran without exhausting its attempts: acme/tidal failed: "
        "us-east-a reports: attempt 3 failed with exit code 127: cannot start 'mpirun': "
        "[Errno 2]; no retry left"
    )
    # The day says its real cause: the failure, not the Placed condition's older text.
    assert "cannot start 'mpirun'" in lines[1] and "scores" not in lines[1]


@pytest.mark.parametrize(
    ("parts", "named"),
    [
        (
            {"cluster_story": {"failed": "the cluster story timed out waiting for a move"}},
            "timed out waiting for a move",
        ),
        (
            {
                "cluster_story": {
                    "lost": "eu-west-a",
                    "detected_s": 31.0,
                    "fenced": True,
                    "identical": True,
                }
            },
            "declared lost 31.0s after its last heartbeat",
        ),
        (
            {
                "cluster_story": {
                    "lost": "eu-west-a",
                    "detected_s": 3.0,
                    "fenced": True,
                    "identical": False,
                }
            },
            "differ from an uninterrupted run's",
        ),
        ({"api_calls": [("/v1/clusters", 200)]}, "calls answered"),
        ({"audit": {"ok": False, "first_broken": 7}}, "the chain breaks at 7"),
        (
            {"serving_day": {"scaled": ["scale out to 2"], "load": {"requests": 9, "failed": 0}}},
            "scaled out 1x and in 0x",
        ),
        (
            {
                "serving_day": {
                    "scaled": ["scale out to 2", "scale in to 1"],
                    "load": {"requests": 9, "failed": 2},
                }
            },
            "2 of 9 requests failed",
        ),
        (
            {"postmortem": {"report": told_loss(faults=[]), "files": {}}},
            "no cluster_lost fault for eu-west-a",
        ),
        (
            {"postmortem": {"report": told_loss(impact={"jobs": []}), "files": {}}},
            "no move of acme/story off eu-west-a",
        ),
        (
            {"postmortem": {"failed": "no events between 1 and 2 (ms)"}},
            "no events between",
        ),
    ],
)
def test_each_step_that_did_not_happen_is_named_with_its_cause(
    parts: dict[str, Any], named: str
) -> None:
    lines = summary_lines(story_steps(played(**parts), scenarios.load("default")))
    assert lines[-1] == "7 of 8 story steps as scripted"
    assert named in lines[0], lines


def test_a_replay_that_differs_is_a_step_not_as_scripted() -> None:
    scheduling = {
        **played().scheduling,
        "replay": {
            "ok": False,
            "matched": 8,
            "decisions": 8,
            "first_difference": "the log has decision 62.0 (of request 62) that the replay "
            "did not make",
        },
    }
    lines = summary_lines(story_steps(played(scheduling=scheduling), scenarios.load("default")))
    assert lines[0].startswith("NOT AS SCRIPTED: a replay of the request log")
    assert "decision 62.0" in lines[0]


def test_each_scenario_names_what_it_needs_from_the_host() -> None:
    assert {name: scenarios.load(name).needs() for name in scenarios.available()} == {
        "dataplane": ("mpi",),
        "default": ("mpi",),
        "heterogeneous": ("mpi",),
        "managers": ("mpi", "slurm", "kubernetes"),
    }


def test_a_missing_tool_is_refused_in_one_line_naming_its_install_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FLEETLINE_KUBERNETES_CACHE", str(tmp_path / "nothing-built"))
    with pytest.raises(needs.MissingTool) as refused:
        needs.require(tmp_path, ["kubernetes"], "fleetline run --scenario managers")
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith("fleetline run --scenario managers needs what this host lacks:")
    assert "Kubernetes v1.37.2 (`make kubernetes`)" in message
    assert isinstance(refused.value, needs.ServiceUnavailable)  # the CLI's exit 69
    assert EXIT_UNAVAILABLE == 69


def test_the_services_need_their_builder_only_until_they_are_built(tmp_path: Path) -> None:
    assert needs.service_needs(tmp_path) == ["java", "maven", "go"]
    libs = tmp_path / f"kafka-{needs.KAFKA_VERSION}" / "libs"
    libs.mkdir(parents=True)
    (libs / ".complete").touch()
    binary = tmp_path / "bin" / f"versitygw-{needs.VERSITYGW_VERSION}"
    binary.parent.mkdir()
    binary.touch()
    assert needs.service_needs(tmp_path) == ["java", "kafka", "s3"]
