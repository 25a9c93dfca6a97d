"""The `fleetline` command loads what its command needs: an agent started on a node or beside
a cluster's manager does not carry the analytics stack (ClickHouse, Arrow) of the control
plane's storage commands. Imported at the top of a command group, that stack cost every
agent process ~0.6 s of start and ~270 MiB of memory."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

HEAVY = ("chdb", "clickhouse_connect", "pyarrow")


@pytest.mark.parametrize(
    "entry",
    [
        "fleetline.cli",
        "fleetline.agents.node",
        "fleetline.agents.cluster.agent",
        "fleetline.agents.router.server",
    ],
)
def test_the_cli_and_the_agents_start_without_the_storage_stack(entry):
    probe = (
        f"import json, sys, fleetline.cli, {entry}; "
        f"print(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True
    ).stdout
    assert json.loads(out) == []


def test_the_storage_commands_still_load_it():
    # The probe above would pass for a module list it cannot see; this one must see chdb.
    probe = (
        "import json, sys; from fleetline.cli.data import _stores; "
        "from fleetline.storage.tiering.loop import tiered_stores; "
        f"print(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True
    ).stdout
    assert "chdb" in json.loads(out)
