"""`make lint`'s check of the Makefile's prerequisites (tools/check_make_needs.py): the real
Makefile passes, and the mistake that made `make run` skip Open MPI is caught."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent
spec = importlib.util.spec_from_file_location(
    "check_make_needs", ROOT / "tools/check_make_needs.py"
)
assert spec is not None and spec.loader is not None
check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(check)

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")


def test_every_target_installs_what_it_plays() -> None:
    rules = check.parsed_rules(ROOT / "Makefile")
    assert check.problems(rules) == []
    assert "mpi" in rules["run"] and rules["mpi"] == ["/usr/bin/mpirun"]


def test_a_tool_variable_defined_below_its_rule_is_caught(tmp_path: Path) -> None:
    text = (ROOT / "Makefile").read_text()
    definition = "MPIRUN := /usr/bin/mpirun\n"
    assert definition in text
    # The mistake as it was: the variable defined after the rule that names it.
    moved = text.replace(definition, "") + "\n" + definition
    broken = tmp_path / "Makefile"
    broken.write_text(moved)
    found = check.problems(check.parsed_rules(broken))
    assert found == ["make mpi names nothing to install (Open MPI)"], found
    # And a target that lost the tool itself.
    lost = text.replace("run: $(STAMP) mpi", "run: $(STAMP)")
    broken.write_text(lost)
    found = check.problems(check.parsed_rules(broken))
    assert len(found) == 1 and found[0].startswith("make run does not install mpi"), found
