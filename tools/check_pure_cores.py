"""`make lint`: every module under fleetline/processors/ is either a pure core (a source of the
"Pure cores" import contract in pyproject.toml) or a declared shell ([tool.fleetline]
shell_modules), so a new module cannot escape the contract by being forgotten."""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PURE_CONTRACT = "Pure cores"


def processor_modules() -> set[str]:
    base = ROOT / "fleetline" / "processors"
    return {
        ".".join(path.relative_to(ROOT).with_suffix("").parts)
        for path in base.rglob("*.py")
        if path.name != "__init__.py"
    }


def main() -> int:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    contracts = config["tool"]["importlinter"]["contracts"]
    pure = next(c for c in contracts if c["name"].startswith(PURE_CONTRACT))
    cores = {m for m in pure["source_modules"] if m.startswith("fleetline.processors.")}
    shells = set(config["tool"]["fleetline"]["shell_modules"])
    modules = processor_modules()
    problems = [
        f"{m}: neither in the {PURE_CONTRACT!r} contract nor in [tool.fleetline] shell_modules"
        for m in sorted(modules - cores - shells)
    ]
    problems += [f"{m}: listed, but no such module" for m in sorted((cores | shells) - modules)]
    problems += [f"{m}: both a pure core and a shell" for m in sorted(cores & shells)]
    for problem in problems:
        print(f"check_pure_cores: {problem}", file=sys.stderr)
    if not problems:
        print(f"check_pure_cores: {len(cores)} pure cores, {len(shells)} shells")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
