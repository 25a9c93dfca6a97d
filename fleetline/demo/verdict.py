"""Whether a played scenario's story happened as scripted: one step per thing the story
promises, each with what was seen and, when it did not happen, its real cause.

`fleetline run` prints the steps after its summary and exits non-zero when any did not
happen; the end-to-end tests read the same list. Pure: it reads what `play` returned.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fleetline.demo.scenario import Scenario
from fleetline.errors import FleetlineError

if TYPE_CHECKING:
    from fleetline.demo.play import SliceResult

# What `play.call_api` asks, as whom (acme's viewer, or a made-up token), and the answer the
# story expects of each call.
SCRIPTED_API_CALLS = (
    ("/v1/clusters", "viewer", 200),
    ("/v1/allocations?tenant=globex", "viewer", 403),
    ("/v1/clusters", "made-up", 401),
)
# A lost cluster is declared within this many seconds of its last heartbeat, or the story's
# self-healing did not happen in time (the health policy's default declares it in 3-5 s).
DECLARED_LOST_WITHIN_S = 10.0


class StoryIncomplete(FleetlineError):
    """A played scenario's story did not happen as scripted: `fleetline run` exits 1."""


@dataclass(frozen=True)
class StoryStep:
    """One promise of the story: kept or not, and why not."""

    name: str
    happened: bool
    cause: str = ""


def _step(name: str, problems: Sequence[str]) -> StoryStep:
    return StoryStep(name, not problems, "; ".join(problems))


def failed_part(part: Mapping[str, Any]) -> str | None:
    """The error a story part stopped with (`play` keeps it instead of ending the run)."""
    failed = part.get("failed")
    return None if failed is None else str(failed)


def last_word(job: Mapping[str, Any]) -> str:
    """What a job that ended said last: its Finished condition (a failure's exit code and
    cause), else its last report."""
    finished = (job.get("conditions") or {}).get("Finished") or {}
    return str(finished.get("reason") or (job.get("actual") or {}).get("detail") or "")


def job_step(failures: Mapping[str, str]) -> StoryStep:
    """Every job the story submitted ran without exhausting its attempts: a job that ended
    Failed (`failures`: job -> its last failure) is named with that failure, not an earlier
    condition's text."""
    return _step(
        "every job ran without exhausting its attempts",
        [f"{key} failed: {why or 'no failure reported'}" for key, why in failures.items()],
    )


def story_steps(result: SliceResult, scenario: Scenario) -> list[StoryStep]:
    """The steps of a played scenario."""
    scheduling: Mapping[str, Any] = result.scheduling
    steps = [job_step(scheduling.get("failures") or {})]
    calls = list(result.api_calls)
    expected = [(path, status) for path, _, status in SCRIPTED_API_CALLS]
    steps.append(
        _step(
            "the API answered a viewer, a tenant it may not read and a made-up token as scripted",
            [] if calls == expected else [f"calls answered {calls}, expected {expected}"],
        )
    )
    audit = result.audit
    steps.append(
        _step(
            "the audit chain verified",
            [] if audit.get("ok") else [f"the chain breaks at {audit.get('first_broken')}"],
        )
    )
    audited = scheduling.get("audited") or {}
    steps.append(
        _step(
            "every decision is in the audit chain with its exact bytes",
            [
                f"{len(audited[k])} decision(s) {k} (first: {audited[k][0]})"
                for k in ("missing", "changed")
                if audited.get(k)
            ],
        )
    )
    replay = scheduling["replay"]
    steps.append(
        _step(
            "a replay of the request log re-made every decision byte for byte",
            []
            if replay["ok"]
            else [
                f"{replay['matched']} of {replay['decisions']} identical: "
                f"{replay['first_difference']}"
            ],
        )
    )
    if scenario.lose_cluster_of:
        steps.append(_cluster_step(scenario.lose_cluster_of, result.cluster_story))
    if scenario.split_job:
        steps.append(_split_step(scenario.split_job, result.split_story))
    if scenario.prewarm:
        steps.append(_prewarm_step(result.prewarm_story))
    if scenario.serving_day:
        steps.append(_serving_step(result.serving_day))
    if scenario.lose_cluster_of:
        steps.append(_postmortem_step(scenario.lose_cluster_of, result))
    return steps


def _postmortem_step(job: str, result: SliceResult) -> StoryStep:
    """The run's postmortem, from the log and the tiers alone, tells the cluster loss as the
    story saw it: the cluster, its detection, the job's move and the chain verified."""
    name = "the postmortem told the cluster loss from the log: detection, the move, the audit"
    failed = failed_part(result.postmortem)
    if failed is not None:
        return _step(name, [failed])
    report = result.postmortem["report"]
    problems = []
    if not report["audit"].get("ok"):
        problems.append(f"the audit chain breaks at {report['audit'].get('first_broken')}")
    story = result.cluster_story
    if not story or "failed" in story:
        return _step(name, problems)  # no loss to tell (its own step says why)
    lost = [
        f for f in report["faults"] if f["kind"] == "cluster_lost" and f["subject"] == story["lost"]
    ]
    if not lost:
        problems.append(f"no cluster_lost fault for {story['lost']}")
    elif lost[0]["detected_ms"] is None:
        problems.append(f"the loss of {story['lost']} has no detection")
    moves = [
        m
        for j in report["impact"]["jobs"]
        if j["job"] == job
        for m in j["moves"]
        if m["from"] == story["lost"] and m["recovery_s"] is not None
    ]
    if not moves:
        problems.append(f"no move of {job} off {story['lost']} with its recovery time")
    return _step(name, problems)


def _cluster_step(job: str, story: Mapping[str, Any]) -> StoryStep:
    name = f"the cluster running {job} was lost, the job resumed elsewhere, bit-identical"
    failed = failed_part(story)
    if failed is not None:
        return _step(name, [failed])
    problems = []
    if story["detected_s"] > DECLARED_LOST_WITHIN_S:
        problems.append(
            f"{story['lost']} declared lost {story['detected_s']}s after its last heartbeat "
            f"(at most {DECLARED_LOST_WITHIN_S:g}s)"
        )
    if not story.get("fenced"):
        problems.append(f"{story['lost']}'s copy was not fenced when it returned")
    if not story.get("identical"):
        problems.append("the final parameters differ from an uninterrupted run's")
    return _step(name, problems)


def _split_step(job: str, story: Mapping[str, Any]) -> StoryStep:
    name = f"{job} split across clusters ended bit-identical to one process"
    failed = failed_part(story)
    if failed is not None:
        return _step(name, [failed])
    return _step(name, [] if story.get("identical") else ["the final parameters differ"])


def _prewarm_step(story: Mapping[str, Any]) -> StoryStep:
    name = "a dataset was copied ahead of its job, every object verified"
    failed = failed_part(story)
    if failed is not None:
        return _step(name, [failed])
    return _step(
        name, [] if story.get("identical") else ["the copied objects do not match the source"]
    )


def _serving_step(day: Mapping[str, Any]) -> StoryStep:
    name = "the serving day scaled its service out and in, and lost no request"
    failed = failed_part(day)
    if failed is not None:
        return _step(name, [failed])
    if "skipped" in day:
        return _step(name, [f"the day was skipped: {day['skipped']}"])
    problems = []
    outs = sum(r.startswith("scale out") for r in day["scaled"])
    ins = sum(r.startswith("scale in") for r in day["scaled"])
    if not outs or not ins:
        problems.append(f"scaled out {outs}x and in {ins}x")
    load = day.get("load") or {}
    if not load.get("requests"):
        problems.append("no request was answered")
    elif load.get("failed"):
        problems.append(f"{load['failed']} of {load['requests']} requests failed")
    return _step(name, problems)


def summary_lines(steps: Sequence[StoryStep]) -> list[str]:
    """The lines `fleetline run` ends with: each step that did not happen, with its cause,
    then 'N of M story steps as scripted'."""
    lines = [f"NOT AS SCRIPTED: {s.name}: {s.cause}" for s in steps if not s.happened]
    kept = sum(s.happened for s in steps)
    lines.append(f"{kept} of {len(steps)} story steps as scripted")
    return lines
