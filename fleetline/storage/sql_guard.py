"""What analyst SQL may name: the store's tables and functions that compute on values, nothing else.

ClickHouse's `readonly=1` stops writes and SETTINGS, but not a scalar `file('/etc/passwd')`, a
file path used as a table (`SELECT * FROM '/etc/passwd'` in embedded ClickHouse), `INTO OUTFILE`,
`merge('system', ...)` or the next function a release adds. So before a query runs, ClickHouse's
own parser turns it into a syntax tree (`parseQueryToJSON`; nothing is executed) and the tree is
held to allow-lists: the kinds of node a SELECT is made of, the functions in
`analyst_functions.txt` (made by tools/analyst_functions.py), a few table functions that generate
numbers, and tables of the store's own database (or the query's own WITH names). Whatever is not
listed is refused, named, before the query is planned.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from functools import cache
from importlib import resources
from typing import Any

# The nodes a SELECT over tables is made of (ClickHouse's AST type names).
NODES = frozenset(
    {
        "SelectWithUnionQuery",
        "SelectIntersectExceptQuery",
        "SelectQuery",
        "ExpressionList",
        "Subquery",
        "WithElement",
        "Function",
        "Identifier",
        "Literal",
        "Asterisk",
        "QualifiedAsterisk",
        "ColumnsRegexpMatcher",
        "ColumnsListMatcher",
        "QualifiedColumnsRegexpMatcher",
        "QualifiedColumnsListMatcher",
        "ColumnsTransformerList",
        "ColumnsApplyTransformer",
        "ColumnsExceptTransformer",
        "ColumnsReplaceTransformer",
        "ColumnsReplaceTransformer::Replacement",
        "TablesInSelectQuery",
        "TablesInSelectQueryElement",
        "TableExpression",
        "TableIdentifier",
        "TableJoin",
        "ArrayJoin",
        "OrderByElement",
        "InterpolateElement",
        "WindowDefinition",
        "WindowListElement",
        "SampleRatio",
    }
)
# Table functions that make values and read nothing.
TABLE_FUNCTIONS = frozenset(
    {"numbers", "numbers_mt", "zeros", "zeros_mt", "values", "generate_series", "generateSeries"}
)
# Clauses that are not the caller's to set, with why.
CLAUSES = {
    "out_file": "INTO OUTFILE writes a file on the store's host",
    "format_ast": "FORMAT: the result's format is the server's",
    "settings_ast": "SETTINGS: the query's limits are the server's",
    "settings": "SETTINGS: the query's limits are the server's",
}
# Functions whose second argument may name a table (`x IN db.table`).
_SET_OPERATORS = frozenset(
    {"in", "notin", "globalin", "globalnotin", "nullin", "notnullin", "globalnullin"}
)


@cache
def allowed_functions() -> frozenset[str]:
    """The functions analyst SQL may call, lower-cased (see tools/analyst_functions.py)."""
    text = resources.files("fleetline.storage").joinpath("analyst_functions.txt").read_text()
    return frozenset(line.strip().lower() for line in text.splitlines() if line.strip())


# Aggregate combinators (`sumIf`, `avgStateOrNull`): system.aggregate_function_combinators.
_COMBINATORS = (
    "SimpleState",
    "OrDefault",
    "Distinct",
    "Resample",
    "ForEach",
    "ArgMax",
    "ArgMin",
    "OrNull",
    "Tuple",
    "Merge",
    "State",
    "Array",
    "Null",
    "Map",
    "If",
)


def function_allowed(name: str) -> bool:
    allowed = allowed_functions()
    while name.lower() not in allowed:
        suffix = next((c for c in _COMBINATORS if name.endswith(c) and len(name) > len(c)), None)
        if suffix is None:
            return False
        name = name.removesuffix(suffix)
    return True


def _nodes(node: Any, key: str = "") -> Iterator[tuple[str, Mapping[str, Any]]]:
    """Every typed node of the tree with the field it hangs from."""
    if isinstance(node, Mapping):
        if "type" in node:
            yield key, node
        for field, child in node.items():
            yield from _nodes(child, field)
    elif isinstance(node, list):
        for child in node:
            yield from _nodes(child, key)


def _parts(node: Mapping[str, Any]) -> list[str]:
    return list(node.get("name_parts") or [node.get("name", "")])


def _not_listed(name: str) -> str:
    return f"function {name}() is not on the analyst allow-list"


def _function(node: Mapping[str, Any], table_function: bool) -> str | None:
    name = str(node.get("name", ""))
    if table_function:
        if name in TABLE_FUNCTIONS:
            return None
        allowed = ", ".join(sorted(TABLE_FUNCTIONS))
        return f"table function {name}() reads outside the store; allowed: {allowed}"
    return None if function_allowed(name) else _not_listed(name)


def refusal(tree: Mapping[str, Any], database: str) -> str | None:
    """Why the parsed query may not run (the first thing found), or None when it may."""
    if tree.get("type") != "SelectWithUnionQuery":
        return f"only SELECT queries are answered (this is {tree.get('type')})"
    nodes = list(_nodes(tree))
    own_names = {n["name"] for _, n in nodes if n["type"] == "WithElement" and "name" in n}

    def table(parts: list[str]) -> str | None:
        if len(parts) == 1 and parts[0] in own_names:
            return None
        if len(parts) == 2 and parts[0] == database:
            return None
        return (
            f"table {'.'.join(parts)!r} is not one of the store's: name them as "
            f"{database}.<table> (or a name the query's own WITH defines)"
        )

    for field, node in nodes:
        kind = node["type"]
        if field in CLAUSES:
            return CLAUSES[field]
        if kind not in NODES:
            return f"{kind} is not part of the SQL analysts may run"
        clause = next((c for c in CLAUSES if c in node), None)
        if clause is not None:
            return CLAUSES[clause]
        if kind == "Function":
            why = _function(node, table_function=field == "table_function")
            if why is None and str(node.get("name", "")).lower() in _SET_OPERATORS:
                arguments = (node.get("arguments") or {}).get("children") or []
                if len(arguments) == 2 and arguments[1].get("type") == "Identifier":
                    why = table(_parts(arguments[1]))
        elif kind == "ColumnsApplyTransformer":
            name = str(node.get("func_name") or "")
            why = None if not name or function_allowed(name) else _not_listed(name)
        elif kind == "TableIdentifier":
            why = table(_parts(node))
        else:
            why = None
        if why is not None:
            return why
    return None
