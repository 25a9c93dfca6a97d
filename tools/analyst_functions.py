"""Writes fleetline/storage/analyst_functions.txt: the ClickHouse functions analyst SQL may call.

The list is made from the embedded ClickHouse's `system.functions` by category: whole categories
that compute on values only (arithmetic, strings, dates, arrays, aggregates, ...), plus a few
named functions from "Other" that do the same. Everything else is left out: functions that read
the host (`file`, `filesystemAvailable`, `hostName`, `getSetting`, `getMacro`, ...), reach the
network (`ai*`) or other stores (dictionaries, `joinGet`), or only stall (`sleep`). A function a
newer ClickHouse adds is refused until this script is run again and the diff reviewed; that is
the point of an allow-list.

    .venv/bin/python tools/analyst_functions.py          # rewrite the list
    .venv/bin/python tools/analyst_functions.py --check  # exit 1 when it would change
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "fleetline" / "storage" / "analyst_functions.txt"

# Categories whose every function computes on its arguments alone.
CATEGORIES = (
    "Aggregate Functions",
    "Arithmetic",
    "Arrays",
    "Bit",
    "Bitmap",
    "Comparison",
    "Conditional",
    "Dates and Times",
    "Distance",
    "Encoding",
    "Financial",
    "Geo",
    "Geo Polygon",
    "Hash",
    "IP Address",
    "JSON",
    "Logical",
    "Map",
    "Mathematical",
    "Null",
    "Random Number",
    "Rounding",
    "String",
    "String Replacement",
    "String Search",
    "String Splitting",
    "Time Series",
    "Time Window",
    "Tuple",
    "Type Conversion",
    "URL",  # parsing URL strings; nothing is fetched
    "UUID",
)
# From "Other": formatting, running values and type introspection of the query's own values.
NAMED = (
    "bar",
    "byteSize",
    "countDigits",
    "currentDatabase",
    "defaultValueOfArgumentType",
    "defaultValueOfTypeName",
    "finalizeAggregation",
    "formatReadableDecimalSize",
    "formatReadableQuantity",
    "formatReadableSize",
    "formatReadableTimeDelta",
    "identity",
    "ignore",
    "initializeAggregation",
    "isConstant",
    "isDecimalOverflow",
    "materialize",
    "neighbor",
    "parseISO8601Duration",
    "parseReadableSize",
    "parseReadableSizeOrNull",
    "parseReadableSizeOrZero",
    "parseTimeDelta",
    "rowNumberInAllBlocks",
    "rowNumberInBlock",
    "runningAccumulate",
    "runningDifference",
    "runningDifferenceStartingWithFirstValue",
    "toColumnTypeName",
    "toTypeName",
    "transform",
    "visibleWidth",
)
# Not in system.functions but what the parser writes for `x -> ...`.
SYNTAX = ("lambda",)


def allowed_names() -> list[str]:
    from chdb import session

    rows = session.Session().query(  # type: ignore[no-untyped-call]
        "SELECT name, alias_to, categories FROM system.functions", "JSONCompact"
    )
    import json

    listed = json.loads(rows.bytes())["data"]
    functions = {name: (alias, category) for name, alias, category in listed}

    def allowed(name: str) -> bool:
        alias, category = functions[name]
        if alias:
            return alias in functions and allowed(alias)
        return category in CATEGORIES or name in NAMED

    names = sorted({n for n in functions if allowed(n)} | set(SYNTAX))
    # Names are matched case-insensitively (the parser keeps what the author typed): no refused
    # function may share a lower-case spelling with an allowed one.
    lowered = {n.lower() for n in names}
    clash = sorted(n for n in functions if not allowed(n) and n.lower() in lowered)
    if clash:
        raise SystemExit(f"refused functions spelled like allowed ones: {clash}")
    return names


def main() -> int:
    text = "".join(f"{name}\n" for name in allowed_names())
    if "--check" in sys.argv[1:]:
        if OUT.read_text() != text:
            print(f"{OUT.relative_to(ROOT)} is out of date: run tools/analyst_functions.py")
            return 1
        return 0
    OUT.write_text(text)
    print(f"{OUT.relative_to(ROOT)}: {text.count(chr(10))} functions")
    return 0


if __name__ == "__main__":
    sys.exit(main())
