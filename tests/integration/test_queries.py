"""Analyst SQL (`fleetline sql`, `fleetline query`, the API's SQL): read-only, within limits
that the query itself cannot lift, over every tier."""

from __future__ import annotations

import dataclasses
import getpass
import hashlib
import os
import time
from datetime import UTC, datetime

import pytest

from fleetline.cli import main
from fleetline.config import QueryLimits
from fleetline.errors import QueryError
from fleetline.processors.audit.runtime import AUDIT_EVENT
from fleetline.storage.clickhouse import connect, migrate
from fleetline.storage.query_service import query_client
from fleetline.storage.tiering.macros import expander
from fleetline.streams import kafka as kafka_clients
from fleetline.streams.serde import default_codec
from fleetline.streams.topics import Topics
from tests.support import fresh_topics, read_all

pytestmark = pytest.mark.services

TIGHT = QueryLimits(
    max_execution_s=0.5,
    max_memory_bytes=100 * 1024**2,
    max_result_rows=1000,
    max_result_bytes=10**6,
)


@pytest.mark.parametrize(
    ("sql", "named"),
    [
        ("SELECT sum(cityHash64(number)) FROM numbers(10000000000)", "FLEETLINE_SQL_MAX_SECONDS"),
        ("SELECT length(groupArray(number)) FROM numbers(100000000)", "MAX_MEMORY_BYTES"),
        ("SELECT number FROM numbers(5000)", "FLEETLINE_SQL_MAX_RESULT_ROWS"),
        # The query cannot lift its own limits, write, or reach outside the store.
        ("SELECT 1 SETTINGS max_execution_time = 3600", "SETTINGS: the query's limits"),
        ("SELECT * FROM file('/etc/passwd', 'LineAsString')", "table function file()"),
        ("CREATE TABLE lifted (a Int8) ENGINE = Memory", "only SELECT"),
    ],
)
def test_an_analyst_query_is_refused_past_its_limits_with_the_reason(clickhouse, sql, named):
    # Only the limit under test is tight: on a busy machine the memory case would otherwise
    # run past the half second first.
    limits = TIGHT if "SECONDS" in named else dataclasses.replace(TIGHT, max_execution_s=60)
    with pytest.raises(QueryError, match="query refused") as refused:
        query_client(clickhouse, sql, limits=limits, database="fleetline")
    assert named in str(refused.value)


def test_a_tiered_query_is_checked_before_its_expansion_runs(settings, clickhouse):
    db = settings.clickhouse_database
    migrate(clickhouse, db)
    expand = expander(settings)
    ok = query_client(clickhouse, "SELECT count() FROM $samples", expand, TIGHT, database=db)
    assert ok.rows == [[0]]
    # The union view is the same surface as $samples.
    assert (
        query_client(clickhouse, f"SELECT count() FROM {db}.gpu_samples_all", expand, database=db)
        == ok
    )
    # The expansion reads the tiers through s3() under readonly=2; what the caller wrote is
    # checked (and planned under readonly=1) first, so no table function, write or SETTINGS of
    # theirs runs.
    for sql, reason in [
        (
            "SELECT count() FROM $samples "
            "WHERE 1 IN (SELECT 1 FROM file('/etc/passwd', 'LineAsString'))",
            "table function file()",
        ),
        (
            "INSERT INTO FUNCTION s3('http://127.0.0.1:1/x.parquet', 'Parquet') "
            "SELECT * FROM $samples",
            "only SELECT",
        ),
        ("SELECT count() FROM $samples SETTINGS max_execution_time = 3600", "SETTINGS"),
    ]:
        with pytest.raises(QueryError, match="query refused") as refused:
            query_client(clickhouse, sql, expand, TIGHT, database=db)
        assert reason in str(refused.value)


def cli_store(settings, monkeypatch) -> str:
    """`fleetline sql` pointed at the test store and broker; the topic prefix it audits to."""
    topics = fresh_topics()
    kafka_clients.ensure_topics(settings.kafka, topics.specs())
    monkeypatch.setenv("FLEETLINE_CLICKHOUSE_URL", settings.clickhouse_url)
    monkeypatch.setenv("FLEETLINE_CLICKHOUSE_DATABASE", settings.clickhouse_database)
    monkeypatch.setenv("FLEETLINE_KAFKA_BOOTSTRAP", settings.kafka.bootstrap_servers)
    for name, value in settings.s3.as_env().items():  # the tiers a macro expands to
        monkeypatch.setenv(name, value)
    migrate(connect(settings.clickhouse_url), settings.clickhouse_database)
    return topics.prefix


def audited_reads(settings, prefix: str, expected: int) -> list[dict]:
    messages = read_all(settings, Topics(prefix).audit_requests, expected)
    codec = default_codec()
    return [codec.decode(m.value(), expect=AUDIT_EVENT).record for m in messages]


def test_fleetline_sql_takes_its_limits_from_the_environment(settings, monkeypatch, capsys):
    prefix = cli_store(settings, monkeypatch)
    monkeypatch.setenv("FLEETLINE_SQL_MAX_RESULT_ROWS", "10")
    assert main(["sql", "SELECT number FROM numbers(5)", "--topic-prefix", prefix]) == 0
    capsys.readouterr()
    assert main(["sql", "SELECT number FROM numbers(100)", "--topic-prefix", prefix]) == 1
    assert "FLEETLINE_SQL_MAX_RESULT_ROWS" in capsys.readouterr().err
    monkeypatch.setenv("FLEETLINE_SQL_MAX_RESULT_ROWS", "many")
    assert main(["sql", "SELECT 1", "--topic-prefix", prefix]) == 1
    assert "FLEETLINE_SQL_MAX_RESULT_ROWS must be a int, got 'many'" in capsys.readouterr().err


def test_a_read_whose_audit_record_the_broker_refuses_shows_nothing(settings, monkeypatch, capsys):
    """The broker answers but will not take the record (here: no audit topic under this
    prefix): the refusal leaves the producer's queue empty, and is still no record."""
    cli_store(settings, monkeypatch)
    monkeypatch.setenv("FLEETLINE_KAFKA_CONF_MESSAGE_TIMEOUT_MS", "3000")
    missing = fresh_topics().prefix
    assert main(["sql", "SELECT number FROM numbers(5)", "--topic-prefix", missing]) == 1
    out = capsys.readouterr()
    assert out.out == "" and "did not take the record of this read" in out.err
    assert f"{missing}.audit" in out.err


def _allocations(clickhouse, db: str, rows: list[list]) -> None:
    """GPU bindings as the allocation sink stores them: ts_ms, job, tenant, cluster, node,
    GPU index, ALLOCATED or RELEASED, seq."""
    columns = ["ts_ms", "job_id", "tenant", "cluster_id", "node_id", "gpu_index", "kind", "seq"]
    clickhouse.insert(f"{db}.gpu_allocations", rows, column_names=columns)


def test_energy_and_its_cost_per_job_and_tenant(settings, clickhouse):
    """Samples are counted for the job whose allocation holds their GPU at the time, priced at
    their cluster's hourly price (the latest profile), with its PUE and renewable share."""
    from fleetline.storage.queries import ready_sql

    db = settings.clickhouse_database
    migrate(clickhouse, db)
    hour = 1_796_000_000_000 // 3_600_000 * 3_600_000  # an hour's start; UTC hour-of-day h
    h = hour // 3_600_000 % 24
    samples = []
    for gpu, power in ((0, 500.0), (1, 250.0)):
        for at_s in (0, 1800, 3599):
            samples.append(["c1", "n1", gpu, hour + at_s * 1000, power])
    samples.append(["c1", "n1", 0, hour + 3_700_000, 700.0])  # after its release: no job's
    clickhouse.insert(
        f"{db}.gpu_samples",
        [[c, n, g, datetime.fromtimestamp(t / 1000, UTC), p] for c, n, g, t, p in samples],
        column_names=["cluster_id", "node_id", "gpu_index", "ts", "power_w"],
    )
    allocations = [
        [hour - 1000, "acme/a", "acme", "c1", "n1", 0, "ALLOCATED", 1],
        [hour - 1000, "globex/b", "globex", "c1", "n1", 1, "ALLOCATED", 1],
        [hour + 3_650_000, "acme/a", "acme", "c1", "n1", 0, "RELEASED", 2],
    ]
    _allocations(clickhouse, db, allocations)
    prices = [[hour - 10, "c1", x, 0.9, 0.0, 1.5, 0, 1, "r"] for x in range(24)]  # superseded
    prices += [[hour, "c1", x, 0.2 if x == h else 0.9, 0.4, 1.5, 0, 2, "r"] for x in range(24)]
    clickhouse.insert(
        f"{db}.energy_prices",
        prices,
        column_names=[
            "ts_ms",
            "cluster_id",
            "hour",
            "price_per_kwh",
            "renewable_share",
            "pue",
            "source_partition",
            "source_offset",
            "source_topic",
        ],
    )
    expand = expander(settings)
    jobs = query_client(
        clickhouse,
        ready_sql("energy-by-job", "0", None),
        expand,
        database=settings.clickhouse_database,
    )
    assert jobs.columns == [
        "job",
        "tenant",
        "gpu_kwh",
        "facility_kwh",
        "energy_cost",
        "renewable_share",
    ]
    assert jobs.rows == [
        ["acme/a", "acme", 0.5, 0.75, 0.15, 0.4],
        ["globex/b", "globex", 0.25, 0.375, 0.075, 0.4],
    ]
    tenants = query_client(
        clickhouse,
        ready_sql("energy-by-tenant", "0", None),
        expand,
        database=settings.clickhouse_database,
    )
    assert [r[:4] for r in tenants.rows] == [
        ["acme", 0.5, 0.75, 0.15],
        ["globex", 0.25, 0.375, 0.075],
    ]


def test_the_tuning_inputs_come_from_the_samples_workload_events_and_allocations(
    settings, clickhouse
):
    from fleetline.storage.queries import (
        checkpoint_costs_sql,
        failure_history_sql,
        memory_by_job_sql,
    )

    db = settings.clickhouse_database
    migrate(clickhouse, db)
    now = int(time.time() * 1000) // 1000 * 1000
    start = now - 2 * 3_600_000
    rows = []
    for gpu in range(2):
        for minute in range(0, 121, 30):
            at = start + minute * 60_000
            xids = [79] if (gpu, minute) == (1, 60) else [63] if minute == 30 else []
            rows.append(
                [
                    "c1",
                    "H100",
                    "n1",
                    gpu,
                    f"GPU-{gpu}",
                    at,
                    20_000 + 1000 * minute // 30,
                    80_000,
                    xids,
                ]
            )
    clickhouse.insert(
        f"{db}.gpu_samples",
        [[*r[:5], datetime.fromtimestamp(r[5] / 1000, UTC), *r[6:]] for r in rows],
        column_names=[
            "cluster_id",
            "model",
            "node_id",
            "gpu_index",
            "gpu_uuid",
            "ts",
            "fb_used_mib",
            "fb_total_mib",
            "xid_codes",
        ],
    )
    _allocations(
        clickhouse,
        db,
        [[start - 1, "acme/j", "acme", "c1", "n1", g, "ALLOCATED", 1] for g in range(2)],
    )
    clickhouse.insert(
        f"{db}.workload_events",
        [
            [now - 1000 * i, "acme/j", "acme", "c1", 1, 0, "CHECKPOINTED", "", s]
            for i, s in enumerate((2.0, 3.0))
        ],
        column_names=[
            "ts_ms",
            "job",
            "tenant",
            "cluster_id",
            "epoch",
            "attempt",
            "event",
            "trace_id",
            "seconds",
        ],
    )
    expand = expander(settings)
    history = query_client(
        clickhouse, failure_history_sql(7), expand, database=settings.clickhouse_database
    ).rows
    # One fatal XID (79; 63 only degrades), two GPUs over two hours.
    assert history == [["c1", "H100", 1, 4.001]]
    costs = query_client(
        clickhouse, checkpoint_costs_sql(7), expand, database=settings.clickhouse_database
    ).rows
    assert [(job, sorted(s)) for job, s in costs] == [("acme/j", [2.0, 3.0])]
    memory = query_client(
        clickhouse, memory_by_job_sql(7), expand, database=settings.clickhouse_database
    ).rows
    assert memory[0][0] == "acme/j" and memory[0][2] == 80_000
    assert 22_000 < memory[0][1] <= 24_000


# Each of these reaches the host, the network, another store, the server's own tables or its
# settings; a query naming one is refused before anything of it runs.
HOST_OR_NETWORK = [
    ("SELECT file('/etc/passwd')", "function file()"),
    ("SELECT FiLe('/etc/passwd')", "function FiLe()"),
    ("SELECT count() FROM '/etc/passwd'", "table '/etc/passwd'"),
    ("SELECT * FROM file('/etc/passwd', 'LineAsString')", "table function file()"),
    ("SELECT * FROM fileCluster('c', '/etc/passwd')", "table function fileCluster()"),
    ("SELECT * FROM url('http://127.0.0.1:1/x.csv', 'CSV')", "table function url()"),
    ("SELECT * FROM s3('http://127.0.0.1:1/b/x.csv', 'CSV')", "table function s3()"),
    ("SELECT * FROM s3Cluster('c', 'http://127.0.0.1:1/b/x')", "table function s3Cluster()"),
    ("SELECT * FROM executable('cat /etc/passwd', 'LineAsString', 'l String')", "executable()"),
    ("SELECT * FROM remote('127.0.0.1', system.one)", "table function remote()"),
    ("SELECT * FROM remoteSecure('127.0.0.1', system.one)", "table function remoteSecure()"),
    ("SELECT * FROM mysql('127.0.0.1:1', 'd', 't', 'u', 'p')", "table function mysql()"),
    ("SELECT * FROM postgresql('127.0.0.1:1', 'd', 't', 'u', 'p')", "postgresql()"),
    ("SELECT * FROM sqlite('/etc/x.db', 't')", "table function sqlite()"),
    ("SELECT * FROM hdfs('hdfs://127.0.0.1:1/x', 'CSV')", "table function hdfs()"),
    ("SELECT * FROM python(x)", "table function python()"),
    ("SELECT * FROM merge('system', '.*')", "table function merge()"),
    ("SELECT * FROM view(SELECT file('/etc/passwd'))", "table function view()"),
    ("SELECT * FROM dictionary('d')", "table function dictionary()"),
    ("SELECT * FROM system.users", "table 'system.users'"),
    ("SELECT query FROM system.processes", "table 'system.processes'"),
    ("SELECT 1 WHERE 1 IN system.one", "table 'system.one'"),
    ("SELECT dictGet('d', 'a', toUInt64(1))", "function dictGet()"),
    ("SELECT joinGet('j', 'v', 1)", "function joinGet()"),
    ("SELECT hostName()", "function hostName()"),
    ("SELECT getSetting('max_memory_usage')", "function getSetting()"),
    ("SELECT getServerSetting('path')", "function getServerSetting()"),
    ("SELECT filesystemAvailable()", "function filesystemAvailable()"),
    ("SELECT getMacro('shard')", "function getMacro()"),
    ("SELECT sleep(3)", "function sleep()"),
    ("SELECT aiGenerate('x')", "function aiGenerate()"),
    ("SELECT * APPLY(file) FROM (SELECT '/etc/passwd' AS p)", "function file()"),
    ("SELECT 1 INTO OUTFILE '/tmp/fleetline-outfile.csv'", "INTO OUTFILE"),
    ("SELECT 1 FORMAT CSV", "FORMAT"),
    ("SELECT 1 SETTINGS readonly = 0", "SETTINGS"),
    ("SHOW TABLES", "only SELECT"),
    ("DESCRIBE TABLE fleetline.gpu_samples", "only SELECT"),
    ("EXPLAIN SELECT file('/etc/passwd')", "only SELECT"),
    ("INSERT INTO FUNCTION file('/tmp/x.csv') SELECT 1", "only SELECT"),
]


@pytest.mark.parametrize(("sql", "named"), HOST_OR_NETWORK)
def test_analyst_sql_names_only_the_stores_tables_and_pure_functions(
    settings, clickhouse, sql, named
):
    db = settings.clickhouse_database
    with pytest.raises(QueryError, match="query refused") as refused:
        query_client(clickhouse, sql, expander(settings), database=db)
    assert named in str(refused.value)
    assert not os.path.exists("/tmp/fleetline-outfile.csv")


def test_what_analysts_write_is_answered(settings, clickhouse):
    db = settings.clickhouse_database
    migrate(clickhouse, db)
    expand = expander(settings)
    rich = (
        "WITH per AS (SELECT number % 3 AS k, number AS v FROM numbers(30)), "
        "ks AS (SELECT k FROM per) "
        "SELECT k, COUNT(*), sumIfOrNull(v, v > 3), quantilesState(0.5)(v) IS NOT NULL, "
        "arrayMap(x -> x + 1, [k])[1], row_number() OVER (ORDER BY k), "
        "formatReadableSize(sum(v)), toStartOfHour(now()) <= now() "
        "FROM per WHERE k IN (SELECT k FROM per) AND k IN ks GROUP BY k ORDER BY k"
    )
    assert len(query_client(clickhouse, rich, expand, database=db).rows) == 3
    samples = f"SELECT count() FROM $samples(-1h) AS s JOIN {db}.gpu_samples AS g USING node_id"
    assert query_client(clickhouse, samples, expand, database=db).rows == [[0]]
    # Every ready query passes the allow-list.
    from fleetline.storage.queries import READY, ready_sql

    for name in READY:
        query_client(clickhouse, ready_sql(name, "-1h", None), expand, database=db)


def test_the_api_and_fleetline_sql_refuse_a_host_function(
    settings, clickhouse, monkeypatch, capsys
):
    from fastapi.testclient import TestClient

    from fleetline.api.app import create_app
    from fleetline.api.auth import AuthConfig, Authenticator, token_digest
    from fleetline.processors.view.read import StaticView
    from tests.fleet_events import fold
    from tests.support import Recorder

    def sql(query: str) -> dict[str, object]:
        result = query_client(clickhouse, query, database=settings.clickhouse_database)
        return {"columns": result.columns, "rows": result.rows}

    admin = {"name": "a", "sha256": token_digest("fl_a"), "role": "platform-admin"}
    app = create_app(
        StaticView(fold([])),
        Authenticator(AuthConfig.from_data({"tokens": [admin]})),
        Recorder(),
        sql=sql,
    )
    client = TestClient(app, headers={"Authorization": "Bearer fl_a"})
    for query in ("SELECT file('/etc/passwd')", "SELECT * FROM '/etc/passwd'"):
        response = client.post("/v1/sql", json={"query": query})
        assert response.status_code == 400, response.text
        assert "query refused" in response.json()["detail"]
        assert "root:" not in response.text
    assert client.post("/v1/sql", json={"query": "SELECT 6 * 7"}).json()["rows"] == [[42]]

    prefix = cli_store(settings, monkeypatch)
    assert main(["sql", "SELECT file('/etc/passwd')", "--topic-prefix", prefix]) == 1
    out = capsys.readouterr()
    assert "function file() is not on the analyst allow-list" in out.err
    assert "root:" not in out.out + out.err


def test_every_read_of_stored_data_is_audited(settings, monkeypatch, capsys):
    """`fleetline sql`, `fleetline query` and the API's SQL record who read, the SQL's digest
    and the rows returned; a read the audit log cannot take shows nothing."""
    prefix = cli_store(settings, monkeypatch)
    query = "SELECT number FROM numbers(3)"
    assert main(["sql", query, "--topic-prefix", prefix]) == 0
    assert capsys.readouterr().out.splitlines() == ["number", "0", "1", "2"]
    assert main(["query", "utilisation-by-cluster", "--topic-prefix", prefix]) == 0
    capsys.readouterr()
    sql_read, ready_read = audited_reads(settings, prefix, 2)
    assert (sql_read["operation"], sql_read["source"], sql_read["actor"]) == (
        "sql.run",
        "cli",
        getpass.getuser(),
    )
    assert sql_read["details"] == {
        "sql_sha256": hashlib.sha256(query.encode()).hexdigest(),
        "rows": "3",
    }
    assert (
        ready_read["operation"] == "sql.ready" and ready_read["target"] == "utilisation-by-cluster"
    )
    assert ready_read["details"]["rows"] == "0"

    monkeypatch.setenv("FLEETLINE_KAFKA_BOOTSTRAP", "127.0.0.1:1")  # no audit log to write to
    assert main(["sql", query, "--topic-prefix", prefix]) == 69  # unavailable
    out = capsys.readouterr()
    assert out.out == "" and "127.0.0.1:1" in out.err

    from fastapi.testclient import TestClient

    from fleetline.api.app import create_app
    from fleetline.api.auth import AuthConfig, Authenticator, token_digest
    from fleetline.processors.view.read import StaticView
    from tests.fleet_events import fold
    from tests.support import Recorder

    recorder = Recorder()
    admin = {"name": "ana", "sha256": token_digest("fl_a"), "role": "platform-admin"}
    app = create_app(
        StaticView(fold([])),
        Authenticator(AuthConfig.from_data({"tokens": [admin]})),
        recorder,
        sql=lambda q: {"columns": ["x"], "rows": [[1], [2]]},
    )
    client = TestClient(app, headers={"Authorization": "Bearer fl_a"})
    assert client.post("/v1/sql", json={"query": "SELECT x FROM t"}).status_code == 200
    (event,) = recorder.events
    assert event["actor"] == "ana" and event["operation"] == "api.POST /v1/sql"
    assert event["details"] == {
        "sql_sha256": hashlib.sha256(b"SELECT x FROM t").hexdigest(),
        "rows": "2",
    }
