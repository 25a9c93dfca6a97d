"""The postmortem's pure core: what a window's records say of its faults, their detection,
the jobs they moved, and the same report byte for byte; its one-line refusals."""

from __future__ import annotations

import pytest

from fleetline.errors import ConfigError
from fleetline.processors.postmortem.render import MAX_ROWS, markdown, page
from fleetline.processors.postmortem.report import IncidentLog, Scope, build, canonical, check

T = 1_796_000_000_000


def incident(scope: Scope | None = None) -> IncidentLog:
    """eu-west-a goes silent at T+10 s and is declared lost 6 s later; a GPU of us-east-a
    falls off the bus at T+20 s and a rule opens a ticket 2 s later; acme/train, at step 130
    in eu-west-a, resumes from step 100 in us-east-a at T+25 s."""
    log = IncidentLog(T, T + 60_000, scope or Scope())
    log.health = [
        {
            "event": "CLUSTER_DOWN",
            "cluster_id": "eu-west-a",
            "seq": 4,
            "ts": T + 16_000,
            "state": "UNHEALTHY",
            "silent_ms": 6_000,
            "reason": "no heartbeat for 6 s",
        }
    ]
    log.xids = [
        {
            "cluster_id": "us-east-a",
            "node_id": "us-east-a-n0000",
            "gpu_index": 3,
            "xid": 79,
            "first_ms": T + 20_000,
        }
    ]
    log.tickets = [
        {
            "ts_ms": T + 22_000,
            "ticket_id": "T1",
            "node_id": "us-east-a-n0000",
            "cluster_id": "us-east-a",
            "rule": "gpu_failed",
            "state": "OPEN",
            "opened_ms": T + 22_000,
            "summary": "xid 79",
        }
    ]
    log.decisions = [
        {
            "ts_ms": T + 17_000,
            "decision_id": "9.0",
            "job": "acme/train",
            "tenant": "acme",
            "kind": "TrainingJob",
            "outcome": "PREEMPTED",
            "reason": "cluster eu-west-a lost",
            "clusters": [],
            "gpus": 8,
            "lost_gpu_s": 240.0,
            "resume_from_checkpoint_ms": T,
        }
    ]

    def w(ts: int, event: str, cluster: str, epoch: int, step: int | None = None, **more):
        return {
            "ts_ms": T + ts,
            "job": "acme/train",
            "tenant": "acme",
            "cluster_id": cluster,
            "epoch": epoch,
            "attempt": 0,
            "event": event,
            "step": step,
            **more,
        }

    log.workloads = [
        w(1_000, "RUNNING", "eu-west-a", 1),
        w(5_000, "PROGRESS", "eu-west-a", 1, 120),
        w(9_000, "PROGRESS", "eu-west-a", 1, 130),
        w(24_000, "RESTORED", "us-east-a", 2, 100, checkpoint_uri="s3://ckpt/100"),
        w(25_000, "RUNNING", "us-east-a", 2),
        w(30_000, "PROGRESS", "us-east-a", 2, 140),
    ]
    log.audit_events = [
        {
            "ts": T + 17_000,
            "actor": "scheduler",
            "operation": "decision.PREEMPTED",
            "target": "acme/train",
            "outcome": "SUCCEEDED",
            "tenant": "acme",
            "event_id": "e1",
            "details": {"reason": "cluster eu-west-a lost"},
        },
        {
            "ts": T + 18_000,
            "actor": "viewer@acme",
            "operation": "api.GET /v1/jobs",
            "target": "/v1/jobs",
            "outcome": "SUCCEEDED",
            "tenant": "acme",
            "event_id": "e2",
            "details": {},
        },
        {
            "ts": T + 19_000,
            "actor": "scheduler",
            "operation": "decision.PLACED",
            "target": "globex/other",
            "outcome": "SUCCEEDED",
            "tenant": "globex",
            "event_id": "e3",
            "details": {"reason": "fits"},
        },
    ]
    log.audit = {
        "ok": True,
        "checked": 3,
        "digests": 1,
        "first_broken": None,
        "unsigned_tail": {"0": 1},
        "window_links": 3,
        "digests_named": [
            {"partition": 0, "covers_seq": 1, "key_id": "k1", "chained_at_ms": T + 20_000}
        ],
    }
    log.dead_letters = [
        {
            "ts_ms": T + 2_000,
            "application": "view",
            "topic": "telemetry",
            "offset": 0,
            "reason": "not Avro",
        }
    ]
    return log


def test_the_report_tells_the_faults_their_detection_and_the_job_s_move():
    report = build(incident())
    faults = {(f["kind"], f["subject"]): f for f in report["faults"]}
    lost = faults[("cluster_lost", "eu-west-a")]
    assert (lost["at_ms"], lost["detected_ms"], lost["detection_s"]) == (
        T + 10_000,
        T + 16_000,
        6.0,
    )
    xid = faults[("xid", "us-east-a-n0000/3")]
    assert xid["detection_s"] == 2.0 and xid["detected_by"].startswith("operations rule gpu_failed")
    (job,) = report["impact"]["jobs"]
    (move,) = job["moves"]
    assert (move["from"], move["to"], move["fault"]) == (
        "eu-west-a",
        "us-east-a",
        "cluster_lost eu-west-a",
    )
    assert (move["last_step_before"], move["resumed_at_step"], move["steps_redone"]) == (
        130,
        100,
        30,
    )
    assert move["recovery_s"] == 15.0 and move["checkpoint"] == "s3://ckpt/100"
    assert job["gpu_hours_lost"] == round(240 / 3600, 4)
    # Reads are not actions; the decisions are, with their actor and reason.
    assert [a["event_id"] for a in report["actions"]] == ["e1", "e3"]
    assert report["series"]["progress"]["acme/train"][-1] == [T + 30_000, 140, "us-east-a"]
    assert canonical(build(incident())) == canonical(report)


def test_a_tenant_s_report_keeps_the_fleet_s_faults_and_only_its_own_jobs():
    report = build(incident(Scope(tenant="globex")))
    assert len(report["faults"]) == 2
    assert report["impact"]["jobs"] == [] and report["dead_letters"] == []
    assert [a["target"] for a in report["actions"]] == ["globex/other"]


def test_markdown_and_html_carry_the_tables_the_plots_and_cap_long_tables():
    log = incident()
    log.audit_events = [
        {**log.audit_events[0], "event_id": f"e{n:05d}", "ts": T + 17_000 + n}
        for n in range(MAX_ROWS + 7)
    ]
    report = build(log)
    md = markdown(report, "Postmortem")
    assert "| xid | us-east-a-n0000/3 |" in md and "7 more rows in the JSON" in md
    assert "Audit chain: verified" in md and "1 links not yet signed" in md
    html = page(report, "Postmortem")
    assert html.count("<svg") == 3  # utilisation, usable GPUs, acme/train's steps
    assert "7 more in the JSON" in html
    # Self-contained: nothing to fetch, nothing to run.
    assert not any(word in html for word in ("<script", "<link", "src=", "url("))


@pytest.mark.parametrize(
    ("scope", "says"),
    [
        (Scope(cluster="nowhere"), "cluster 'nowhere' has no records"),
        (Scope(job="acme/ghost"), "job 'acme/ghost' has no decisions"),
        (Scope(node="n9"), "node 'n9' has no records"),
        (Scope(service="acme/none"), "service 'acme/none' has no records"),
    ],
)
def test_a_scope_the_window_never_saw_is_refused_in_one_line(scope, says):
    with pytest.raises(ConfigError, match=says):
        check(incident(scope))


def test_a_window_with_no_events_is_refused():
    with pytest.raises(ConfigError, match="no events between"):
        check(IncidentLog(T, T + 1))


def test_a_link_both_ends_report_broken_is_one_fault_from_the_first_report():
    log = incident()
    log.health += [
        {
            "event": "PARTITION",
            "cluster_id": a,
            "peer": b,
            "seq": n,
            "ts": T + 30_000 + n,
            "state": "HEALTHY",
            "link_up": False,
            "reason": f"{a} cannot reach {b}",
        }
        for n, (a, b) in enumerate([("ap-south-a", "eu-west-a"), ("eu-west-a", "ap-south-a")])
    ]
    cuts = [f for f in build(log)["faults"] if f["kind"] == "link_cut"]
    assert [(f["subject"], f["at_ms"]) for f in cuts] == [("ap-south-a <-> eu-west-a", T + 30_000)]
