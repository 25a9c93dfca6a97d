"""Analyst SQL (`fleetline sql`, `fleetline query`, the API's SQL): read-only, within limits
that the query itself cannot lift, over every tier."""

from __future__ import annotations

import pytest

from fleetline.cli import main
from fleetline.config import QueryLimits
from fleetline.errors import QueryError
from fleetline.storage.clickhouse import migrate
from fleetline.storage.query_service import query_client
from fleetline.storage.tiers import expander

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
        ("SELECT 1 SETTINGS max_execution_time = 3600", "read-only"),
        ("SELECT * FROM file('/etc/passwd', 'LineAsString')", "read-only"),
        ("CREATE TABLE lifted (a Int8) ENGINE = Memory", "read-only"),
    ],
)
def test_an_analyst_query_is_refused_past_its_limits_with_the_reason(clickhouse, sql, named):
    with pytest.raises(QueryError, match="query refused") as refused:
        query_client(clickhouse, sql, limits=TIGHT)
    assert named in str(refused.value)


def test_a_tiered_query_is_checked_before_its_expansion_runs(settings, clickhouse):
    db = settings.clickhouse_database
    migrate(clickhouse, db)
    expand = expander(settings)
    ok = query_client(clickhouse, "SELECT count() FROM $samples", expand, TIGHT)
    assert ok.rows == [[0]]
    # The union view is the same surface as $samples.
    assert query_client(clickhouse, f"SELECT count() FROM {db}.gpu_samples_all", expand) == ok
    # The expansion reads the tiers through s3() under readonly=2; what the caller wrote is
    # planned under readonly=1 first, so no table function, write or SETTINGS of theirs runs.
    for sql in [
        "SELECT count() FROM $samples "
        "WHERE 1 IN (SELECT 1 FROM file('/etc/passwd', 'LineAsString'))",
        "INSERT INTO FUNCTION s3('http://127.0.0.1:1/x.parquet', 'Parquet') SELECT * FROM $samples",
        "SELECT count() FROM $samples SETTINGS max_execution_time = 3600",
    ]:
        with pytest.raises(QueryError, match="read-only"):
            query_client(clickhouse, sql, expand, TIGHT)


def test_fleetline_sql_takes_its_limits_from_the_environment(settings, monkeypatch, capsys):
    monkeypatch.setenv("FLEETLINE_CLICKHOUSE_URL", settings.clickhouse_url)
    monkeypatch.setenv("FLEETLINE_SQL_MAX_RESULT_ROWS", "10")
    assert main(["sql", "SELECT number FROM numbers(5)"]) == 0
    capsys.readouterr()
    assert main(["sql", "SELECT number FROM numbers(100)"]) == 1
    assert "FLEETLINE_SQL_MAX_RESULT_ROWS" in capsys.readouterr().err
    monkeypatch.setenv("FLEETLINE_SQL_MAX_RESULT_ROWS", "many")
    assert main(["sql", "SELECT 1"]) == 1
    assert "FLEETLINE_SQL_MAX_RESULT_ROWS must be a int, got 'many'" in capsys.readouterr().err
