"""A postmortem read from the tiers: the same report, byte for byte, while the window's rows
are hot, once they have moved to warm, and from cold once restored; a cold archive not
restored is named rather than read as a window where nothing happened. And the command's
bad input: one line each, exit 1, no file written."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from fleetline.agents.simulator import ClusterSpec, Fault, FleetSimulator
from fleetline.cli import main
from fleetline.processors.postmortem.gather import incident_report
from fleetline.processors.postmortem.report import Scope, canonical
from fleetline.storage.clickhouse import migrate
from fleetline.storage.hot_sink import HotSampleStore, SourcedTelemetry, to_columns
from fleetline.storage.objects import ObjectStore
from fleetline.storage.query_service import QueryResult
from fleetline.storage.tiering.loop import tiered_stores
from fleetline.storage.tiering.macros import tiered_sql
from fleetline.storage.tiering.policy import DAY_MS, HOUR_MS, LIFETIMES
from fleetline.streams import kafka as kafka_clients
from tests.support import BASE_MS, fresh_topics

pytestmark = pytest.mark.services
NOW = (BASE_MS // DAY_MS) * DAY_MS + 12 * HOUR_MS
INTERVAL_MS = 10 * 60 * 1000
# The incident: three days before NOW, a GPU falls off the bus.
FAULT_MS = NOW - 3 * DAY_MS + 2 * HOUR_MS
WINDOW = (FAULT_MS - HOUR_MS, FAULT_MS + 2 * HOUR_MS)


def load(clickhouse, db: str) -> None:
    """Four days of telemetry (the fault in them), and the decision that moved the job off
    the GPU, as the sinks store them."""
    migrate(clickhouse, db)
    sim = FleetSimulator(
        [ClusterSpec("c1", "eu-west", 2), ClusterSpec("c2", "us-east", 1)],
        seed=5,
        interval_ms=INTERVAL_MS,
        faults=[Fault("xid", "c1-n0001/2", FAULT_MS, None, 79)],
    )
    start = NOW - 4 * DAY_MS
    batch = [
        SourcedTelemetry(0, i, record)
        for i, record in enumerate(
            r
            for t in range(4 * DAY_MS // INTERVAL_MS)
            for r in sim.telemetry(start + t * INTERVAL_MS)
        )
    ]
    HotSampleStore(clickhouse, db).store(to_columns(batch))
    clickhouse.insert(
        f"{db}.scheduling_decisions",
        [
            [
                FAULT_MS + 4 * 60_000,
                "d1",
                "acme/train",
                "acme",
                "TrainingJob",
                "PREEMPTED",
                "fault: c1-n0001 GPU(s) [2] failed (xid 79); migrating from its last checkpoint",
                3,
                1,
                "decisions",
            ]
        ],
        column_names=[
            "ts_ms",
            "decision_id",
            "job",
            "tenant",
            "kind",
            "outcome",
            "reason",
            "priority",
            "source_offset",
            "source_topic",
        ],
    )


def test_a_postmortem_reads_the_same_from_every_tier_and_names_cold_not_restored(
    settings, clickhouse
):
    db = settings.clickhouse_database
    load(clickhouse, db)
    topics = fresh_topics()
    kafka_clients.ensure_topics(settings.kafka, topics.specs())
    objects = ObjectStore.from_settings(settings.s3)
    objects.ensure_bucket()
    # Short lifetimes: the window (three days back) goes warm after a day, cold after two.
    lifetimes = {
        name: replace(LIFETIMES[name], hot_ms=DAY_MS, warm_ms=2 * DAY_MS)
        for name in ("samples", "decisions")
    }

    def stores():
        return tiered_stores(clickhouse, db, objects, settings.s3, lifetimes, root=f"pm-{db}")

    def report() -> str:
        tiers = stores()
        samples = tiers.pop("samples")

        def sql(query: str) -> QueryResult:
            result = clickhouse.query(tiered_sql(samples, query, tables=tiers, now_ms=NOW))
            return QueryResult(list(result.column_names), [list(r) for r in result.result_rows])

        return canonical(incident_report(settings.kafka, topics, sql, *WINDOW, Scope(), {}))

    hot = report()
    found = build_faults(hot)
    assert found == [("xid", "c1-n0001/2", FAULT_MS)], found
    # The job's move names the fault: detected by the decision four minutes later.
    assert '"detection_s": 240.0' in hot and "scheduler decision d1" in hot
    # Two days on, the window is warm: the same report, byte for byte.
    for store in stores().values():
        store.run_once(NOW - DAY_MS)
    assert (
        clickhouse.query(
            f"SELECT count() FROM {db}.gpu_samples WHERE ts < fromUnixTimestamp64Milli({WINDOW[1]})"
        ).result_rows[0][0]
        == 0
    ), "the window's samples should have left the hot table"
    assert report() == hot
    # Later still, cold: not readable in place, so named until restored, then the same again.
    for store in stores().values():
        store.run_once(NOW)
    missing = [m.partition for s in stores().values() for m in s.unrestored(*WINDOW)]
    assert missing, "the window should be in cold archives now"
    for store in stores().values():
        store.restore(*WINDOW)
    assert [m for s in stores().values() for m in s.unrestored(*WINDOW)] == []
    assert report() == hot


def build_faults(text: str) -> list[tuple[str, str, int]]:
    import json

    return [(f["kind"], f["subject"], f["at_ms"]) for f in json.loads(text)["faults"]]


def test_the_postmortem_command_says_bad_input_in_one_line_and_writes_nothing(
    settings, clickhouse, tmp_path, monkeypatch, capsys
):
    from tests.services import service_env

    db = settings.clickhouse_database
    load(clickhouse, db)
    topics = fresh_topics()
    kafka_clients.ensure_topics(settings.kafka, topics.specs())
    chdb_dir = settings.clickhouse_url.removeprefix("chdb://")
    for key, value in service_env(settings, Path(chdb_dir)).items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("FLEETLINE_CLICKHOUSE_DATABASE", db)
    out = tmp_path / "pm"
    common = ["--topic-prefix", topics.prefix, "--out", str(out)]
    window = ["--from", str(WINDOW[0]), "--to", str(WINDOW[1])]
    cases = [
        (["--from", str(NOW + DAY_MS), "--to", str(NOW + 2 * DAY_MS)], "no events between"),
        ([*window, "--cluster", "nowhere"], "cluster 'nowhere' has no records in the window"),
        ([*window, "--job", "acme/ghost"], "job 'acme/ghost' has no decisions"),
        ([*window, "--node", "c9-n0000"], "node 'c9-n0000' has no records"),
        (["--from", str(WINDOW[1]), "--to", str(WINDOW[0])], "ends"),
        (["--from", "yesterday"], "neither epoch milliseconds nor an ISO 8601 time"),
    ]
    for argv, says in cases:
        capsys.readouterr()
        assert main(["postmortem", *argv, *common]) == 1, argv
        err = capsys.readouterr().err.strip()
        assert says in err and len(err.splitlines()) == 1, (argv, err)
        assert not list(tmp_path.iterdir()), argv
    # The window itself: three files, and the same JSON when asked again.
    assert main(["postmortem", *window, *common]) == 0
    first = (tmp_path / "pm.json").read_text()
    assert main(["postmortem", *window, *common]) == 0
    assert (tmp_path / "pm.json").read_text() == first
    assert {p.name for p in tmp_path.iterdir()} == {"pm.json", "pm.md", "pm.html"}
    assert "| xid | c1-n0001/2 |" in (tmp_path / "pm.md").read_text()
