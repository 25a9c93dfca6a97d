"""`fleetline doctor`: what each command and scenario needs from this host, whether it is here
(with its version) and the one command that installs it (the list is infra/needs.py's)."""

from __future__ import annotations

from pathlib import Path

import typer

from fleetline.cli.common import settings


def needs_by_command(cache_dir: Path) -> dict[str, list[str]]:
    """Each command or make target, and the tools (keys of `infra/needs.TOOLS`) it needs."""
    from fleetline.demo import scenario as scenarios
    from fleetline.infra.needs import MAKE_TARGETS, service_needs

    services = service_needs(cache_dir)
    out: dict[str, list[str]] = {
        "fleetline infra start / serve": services,
        "fleetline infra start --slurm": ["slurm"],
        "fleetline infra start --kubernetes": ["kubernetes"],
    }
    for name in scenarios.available():
        out[f"fleetline run --scenario {name}"] = [*services, *scenarios.load(name).needs()]
    out["fleetline run --lab"] = ["root"]
    out["make run"] = [*services, *scenarios.load("default").needs()]
    out["make lint"] = ["node"]
    for target, tools in MAKE_TARGETS.items():
        out[f"make {target}"] = [*services, *tools]
    out["make test"] += ["go", "node", "root"]
    return {k: list(dict.fromkeys(v)) for k, v in out.items()}


def doctor() -> None:
    """What each command and scenario needs from this host, whether it is here (with its
    version), and the one command that installs what is missing. `fleetline run` checks the
    same list before it starts anything and refuses (exit 69) when a tool is missing."""
    from fleetline.infra.needs import examine

    cache_dir = settings(kind=None).cache_dir
    found = {f.tool.key: f for f in examine(cache_dir)}
    width = max(len(f.tool.name) for f in found.values())
    print("tools:")
    for finding in found.values():
        tool = finding.tool
        state = f"{finding.version}" if finding.here else f"MISSING: {tool.install}"
        print(f"  {'ok' if finding.here else '--':<3}{tool.name:<{width}}  {state}")
        print(f"     {'':<{width}}  ({tool.why})")
    print("commands:")
    for command, keys in needs_by_command(cache_dir).items():
        missing = [found[k].tool.name for k in keys if not found[k].here]
        state = "ready" if not missing else "missing " + ", ".join(missing)
        print(f"  {command}: {state}")
        print(f"      needs {', '.join(found[k].tool.name for k in keys)}")


def register(app: typer.Typer) -> None:
    app.command(name="doctor")(doctor)
