"""Commands whose services are down fail fast, in one line that names the service, its address
and what to do, with an exit code of their own (69) apart from a refused input (1)."""

from __future__ import annotations

import socket

import pytest

from fleetline.cli import main
from fleetline.errors import EXIT_UNAVAILABLE

SPECS = "tests/specs/llm-pretrain.yaml"


def dead_port() -> int:
    """A loopback port nothing listens on (bound, then let go)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def down(monkeypatch) -> dict[str, str]:
    addresses = {
        "kafka": f"127.0.0.1:{dead_port()}",
        "s3": f"127.0.0.1:{dead_port()}",
        "clickhouse": f"127.0.0.1:{dead_port()}",
        "api": f"127.0.0.1:{dead_port()}",
    }
    monkeypatch.setenv("FLEETLINE_SERVER", f"http://{addresses['api']}")  # where writes go
    monkeypatch.setenv("FLEETLINE_TOKEN", "fl_operator")
    monkeypatch.setenv("FLEETLINE_KAFKA_BOOTSTRAP", addresses["kafka"])
    monkeypatch.setenv("FLEETLINE_S3_ENDPOINT", addresses["s3"])
    monkeypatch.setenv("FLEETLINE_CLICKHOUSE_URL", f"http://{addresses['clickhouse']}")
    return addresses


@pytest.mark.parametrize(
    ("argv", "service"),
    [
        (["apply", "-f", SPECS], "api"),
        (["delete", "acme/llm-pretrain"], "api"),
        (["get", "jobs"], "kafka"),
        (["describe", "acme/llm-pretrain"], "kafka"),
        (["explain", "acme/llm-pretrain"], "kafka"),
        (["quota", "set", "acme", "--gpus", "8"], "api"),
        (["cluster", "cordon", "c1"], "api"),
        (["replay", "--at", "0", "--no-snapshots"], "kafka"),
        (["view", "clusters"], "kafka"),
        (["audit", "verify"], "kafka"),
        (["audit", "search"], "clickhouse"),
        (["sql", "SELECT 1"], "clickhouse"),
        (["query", "utilisation-by-cluster"], "clickhouse"),
        (["tier", "run"], "s3"),
        (["command", "n1", "DRAIN", "--cluster-id", "c1"], "api"),
        (["run", "--external-services"], "kafka"),
    ],
)
def test_a_command_whose_service_is_down_says_so_in_one_line(down, capsys, argv, service):
    assert main(argv) == EXIT_UNAVAILABLE
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("fleetline: unavailable: ")
    assert down[service] in err[0]
    assert any(
        hint in err[0]
        for hint in ("fleetline infra start", "FLEETLINE_CLICKHOUSE_URL", "fleetline login")
    )


def test_a_bad_spec_is_refused_before_the_api_is_asked(down, tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("kind: TrainingJob\nmetadata: {name: x, tenant: acme}\nspec: {workers: -1}\n")
    assert main(["apply", "-f", str(bad)]) == 1
    assert "spec.workers: must be >= 1, got -1" in capsys.readouterr().err
