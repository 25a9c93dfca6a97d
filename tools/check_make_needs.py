"""`make lint`'s check that each Makefile target installs what it plays before it runs.

make expands a rule's prerequisites as it reads the rule, so a tool variable defined further
down is empty there and the tool silently drops out of the list (`run` once lost Open MPI that
way, and exited 0 with half its story failed). This reads the rules as make itself parsed them
(`make -pRrq`) and holds each target to infra/needs.py: `run` to what the default scenario
needs, the others to `MAKE_TARGETS`; and each tool's own target to a non-empty rule.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from fleetline.demo.scenario import load
from fleetline.infra.needs import MAKE_TARGETS, TOOLS

ROOT = Path(__file__).resolve().parent.parent


def parsed_rules(makefile: Path) -> dict[str, list[str]]:
    """Each target's prerequisites as make reads them (its database, nothing run)."""
    printed = subprocess.run(
        ["make", "-pRrq", "-f", str(makefile), ":"],
        cwd=makefile.parent,
        capture_output=True,
        text=True,
        check=False,
    ).stdout
    rules: dict[str, list[str]] = {}
    for line in printed.splitlines():
        if line.startswith(("#", "\t", " ")) or ":" not in line or line.startswith("."):
            continue
        target, sep, rest = line.partition(":")
        if sep and not rest.startswith("=") and " " not in target:
            rules.setdefault(target, []).extend(rest.split())
    return rules


def problems(rules: dict[str, list[str]]) -> list[str]:
    expected = {"run": load("default").needs(), **MAKE_TARGETS}
    make_target = {t.key: t.make_target for t in TOOLS}
    out = []
    for target, keys in expected.items():
        if target not in rules:
            out.append(f"the Makefile has no target {target!r}")
            continue
        for key in keys:
            wanted = make_target[key]
            if wanted is None:
                out.append(f"infra/needs.py: {key} has no make target for {target!r} to name")
            elif wanted not in rules[target]:
                out.append(
                    f"make {target} does not install {key}: its prerequisites are "
                    f"{' '.join(rules[target]) or 'none'}, without {wanted!r}"
                )
    for tool in TOOLS:
        if tool.make_target is None:
            continue
        if tool.make_target not in rules:
            out.append(f"the Makefile has no target {tool.make_target!r} ({tool.name})")
        elif not rules[tool.make_target]:
            out.append(f"make {tool.make_target} names nothing to install ({tool.name})")
    return out


def main() -> int:
    found = problems(parsed_rules(ROOT / "Makefile"))
    for line in found:
        print(f"check_make_needs: {line}", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
