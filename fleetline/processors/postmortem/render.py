"""A postmortem report as Markdown (for a ticket) and as one self-contained HTML page (plots
inline as SVG: it reads offline, nothing is fetched). Pure: the report in, text out."""

from __future__ import annotations

import html
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

# Rows a table shows (the JSON holds them all) and jobs whose progress is plotted (those that
# redid the most steps): a fleet-wide hour can move thousands of jobs.
MAX_ROWS = 500
MAX_PLOTTED_JOBS = 12

_COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#17becf")


def when(ms: int | None) -> str:
    if ms is None:
        return "-"
    return datetime.fromtimestamp(ms / 1000, UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + "Z"


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:g} s"


Table = tuple[tuple[str, ...], list[tuple[str, ...]]]


def _rows(report: Mapping[str, Any]) -> dict[str, Table]:
    """The report's tables: name -> (columns, rows of text), the same in both formats."""
    faults: list[tuple[str, ...]] = [
        (
            when(f["at_ms"]),
            f["kind"],
            f["subject"],
            f["what"],
            when(f["detected_ms"]),
            _seconds(f["detection_s"]),
            f["detected_by"] or "NOT DETECTED",
        )
        for f in report["faults"]
    ]
    actions: list[tuple[str, ...]] = [
        (when(a["at_ms"]), a["actor"], a["operation"], a["target"], a["where"], a["reason"][:140])
        for a in report["actions"]
    ]
    jobs: list[tuple[str, ...]] = [
        (
            j["job"],
            f"{m['from']} -> {m['to']}",
            m["fault"] or (f"decision: {m['decision'][:80]}" if m["decision"] else "-"),
            "-" if m["last_step_before"] is None else str(m["last_step_before"]),
            str(m["resumed_at_step"]),
            "-" if m["steps_redone"] is None else str(m["steps_redone"]),
            _seconds(m["recovery_s"]),
            m["checkpoint"] or "-",
        )
        for j in report["impact"]["jobs"]
        for m in j["moves"]
    ]
    services: list[tuple[str, ...]] = [
        (
            s["service"],
            str(s["requests"]),
            str(s["failed"]),
            f"{s['p50_of_p95_ms']}",
            f"{s['max_p95_ms']}",
        )
        for s in report["impact"]["services"]
    ]
    audit = report["audit"]
    digests: list[tuple[str, ...]] = [
        (str(d["partition"]), str(d["covers_seq"]), d["key_id"], when(d.get("chained_at_ms")))
        for d in audit.get("digests_named", [])
    ]
    tables: dict[str, Table] = {
        "Faults and their detection": (
            ("fault at", "kind", "what failed", "how", "detected at", "after", "detected by"),
            faults,
        ),
        "What followed": (("at", "actor", "action", "target", "where", "reason"), actions),
        "Impact on jobs": (
            (
                "job",
                "moved",
                "why",
                "last step",
                "resumed at",
                "steps redone",
                "fault to running",
                "checkpoint",
            ),
            jobs,
        ),
        "Impact on services": (
            ("service", "requests", "failed", "median p95 ms", "worst p95 ms"),
            services,
        ),
        "Signed digests over the window": (
            ("partition", "covers seq", "key", "chained at"),
            digests,
        ),
    }
    return tables


def _audit_line(report: Mapping[str, Any]) -> str:
    a = report["audit"]
    if not a:
        return "The audit chain was not checked."
    tail = a.get("unsigned_tail") or 0
    unsigned = sum(tail.values()) if isinstance(tail, Mapping) else int(tail)
    return (
        f"Audit chain: {'verified' if a.get('ok') else 'BROKEN at ' + str(a.get('first_broken'))}"
        f" — {a.get('checked', 0)} links checked from genesis, {a.get('window_links', 0)} in the "
        f"window, {a.get('digests', 0)} signed digests ({len(a.get('digests_named', []))} over "
        f"the window), {unsigned} links not yet signed."
    )


def markdown(report: Mapping[str, Any], title: str = "Postmortem") -> str:
    w = report["window"]
    out = [
        f"# {title}",
        "",
        f"Window: {when(w['from_ms'])} to {when(w['to_ms'])}"
        + (f" ({', '.join(f'{k} {v}' for k, v in w['scope'].items())})" if w["scope"] else ""),
        "",
        report["summary"],
        "",
        _audit_line(report),
        "",
    ]
    for name, (columns, rows) in _rows(report).items():
        out += [f"## {name}", ""]
        if not rows:
            out += ["none", ""]
            continue
        out.append("| " + " | ".join(columns) + " |")
        out.append("|" + "---|" * len(columns))
        out += [
            "| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in rows[:MAX_ROWS]
        ]
        if len(rows) > MAX_ROWS:
            out += ["", f"{len(rows) - MAX_ROWS} more rows in the JSON"]
        out.append("")
    if report["dead_letters"]:
        out += [f"## Dead letters ({len(report['dead_letters'])})", ""]
        out += [
            f"- {when(d['ts_ms'])} {d['application']} <- {d['topic']}: {d['reason'][:160]}"
            for d in report["dead_letters"]
        ]
        out.append("")
    out.append(f"Tiers read: {', '.join(report['tiers']) or 'none'}")
    return "\n".join(out) + "\n"


def _line_chart(
    title: str,
    series: Mapping[str, Sequence[Sequence[Any]]],
    window: Mapping[str, Any],
    unit: str,
    marks: Sequence[tuple[int, str]] = (),
) -> str:
    """One SVG line chart: a line per series over the window, faults marked as verticals."""
    width, height, left, bottom, top = 720, 220, 56, 28, 24
    x0 = int(window["from_ms"])
    x1 = max(int(window["to_ms"]), x0 + 1)
    values = [float(p[1]) for points in series.values() for p in points]
    y1 = max(values, default=1.0) or 1.0
    y1 = y1 * 1.1

    def x(t: float) -> float:
        return left + (t - x0) / (x1 - x0) * (width - left - 8)

    def y(v: float) -> float:
        return height - bottom - v / y1 * (height - bottom - top)

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'role="img" aria-label="{html.escape(title)}">',
        f'<text x="{left}" y="16" font-size="13" font-weight="bold">{html.escape(title)}</text>',
        f'<line x1="{left}" y1="{height - bottom}" x2="{width - 8}" y2="{height - bottom}" '
        'stroke="#888"/>',
        f'<line x1="{left}" y1="{top}" x2="{left}" y2="{height - bottom}" stroke="#888"/>',
        f'<text x="4" y="{top + 10}" font-size="11">{y1:.4g} {html.escape(unit)}</text>',
        f'<text x="4" y="{height - bottom}" font-size="11">0</text>',
        f'<text x="{left}" y="{height - 8}" font-size="11">{when(x0)[11:19]}</text>',
        f'<text x="{width - 70}" y="{height - 8}" font-size="11">{when(x1)[11:19]}</text>',
    ]
    for at, label in marks:
        if x0 <= at <= x1:
            parts.append(
                f'<line x1="{x(at):.1f}" y1="{top}" x2="{x(at):.1f}" y2="{height - bottom}" '
                'stroke="#d62728" stroke-dasharray="4 3">'
                f"<title>{html.escape(label)}</title></line>"
            )
    for i, (name, points) in enumerate(sorted(series.items())):
        colour = _COLOURS[i % len(_COLOURS)]
        path = " ".join(f"{x(float(p[0])):.1f},{y(float(p[1])):.1f}" for p in points)
        if path:
            parts.append(
                f'<polyline fill="none" stroke="{colour}" stroke-width="2" points="{path}">'
                f"<title>{html.escape(name)}</title></polyline>"
            )
        parts.append(
            f'<text x="{width - 200}" y="{top + 14 * (i + 1)}" font-size="11" fill="{colour}">'
            f"{html.escape(name)}</text>"
        )
    parts.append("</svg>")
    return "".join(parts)


def page(report: Mapping[str, Any], title: str = "Postmortem") -> str:
    """One self-contained HTML file."""
    w, series = report["window"], report["series"]
    marks = [(f["at_ms"], f"{f['kind']} {f['subject']}") for f in report["faults"]]
    charts = [
        _line_chart("GPU utilisation by cluster", series["utilisation"], w, "%", marks),
        _line_chart("Usable GPUs by cluster", series["usable_gpus"], w, "GPUs", marks),
    ]
    redone = {j["job"]: j["steps_redone"] for j in report["impact"]["jobs"]}
    plotted = sorted(series["progress"], key=lambda j: (-(redone.get(j) or 0), j))
    for job in sorted(plotted[:MAX_PLOTTED_JOBS]):
        points = series["progress"][job]
        charts.append(
            _line_chart(
                f"{job}: training step across its move ({' -> '.join(_clusters(points))})",
                {job: points},
                w,
                "steps",
                marks,
            )
        )
    for s in report["impact"]["services"]:
        charts.append(
            _line_chart(f"{s['service']}: requests per report", {"rate": s["rate"]}, w, "req")
        )
        charts.append(_line_chart(f"{s['service']}: p95 latency", {"p95": s["p95"]}, w, "ms"))
    tables = []
    for name, (columns, rows) in _rows(report).items():
        head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
        body = (
            "".join(
                "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>"
                for row in rows[:MAX_ROWS]
            )
            or f'<tr><td colspan="{len(columns)}">none</td></tr>'
        )
        if len(rows) > MAX_ROWS:
            more = len(rows) - MAX_ROWS
            body += f'<tr><td colspan="{len(columns)}">{more} more in the JSON</td></tr>'
        tables.append(f"<h2>{html.escape(name)}</h2><table><tr>{head}</tr>{body}</table>")
    health = "".join(
        f"<li>{html.escape(c)}: "
        + ", ".join(f"{html.escape(s)} at {when(t)[11:23]}" for t, s in points)
        + "</li>"
        for c, points in sorted(series["health"].items())
    )
    scope = ", ".join(f"{k} {v}" for k, v in w["scope"].items())
    return (
        "<!doctype html><html lang=en><head><meta charset=utf-8>"
        f"<title>{html.escape(title)}</title><style>"
        "body{font-family:sans-serif;margin:24px;max-width:1100px}"
        "table{border-collapse:collapse;margin-bottom:16px;font-size:13px}"
        "td,th{border:1px solid #ccc;padding:3px 6px;text-align:left;vertical-align:top}"
        "th{background:#f2f2f2}.ok{color:#2ca02c}.broken{color:#d62728}"
        "</style></head><body>"
        f"<h1>{html.escape(title)}</h1>"
        f"<p>{when(w['from_ms'])} to {when(w['to_ms'])}"
        + (f" ({html.escape(scope)})" if scope else "")
        + f"</p><p><b>{html.escape(report['summary'])}</b></p>"
        f'<p class="{"ok" if report["audit"].get("ok") else "broken"}">'
        f"{html.escape(_audit_line(report))}</p>"
        + "".join(f"<div>{c}</div>" for c in charts)
        + (f"<h2>Cluster health</h2><ul>{health}</ul>" if health else "")
        + "".join(tables)
        + f"<p>Tiers read: {html.escape(', '.join(report['tiers']) or 'none')}; "
        f"{len(report['dead_letters'])} dead letter(s).</p></body></html>\n"
    )


def _clusters(points: Sequence[Sequence[Any]]) -> list[str]:
    out: list[str] = []
    for p in points:
        if not out or out[-1] != p[2]:
            out.append(str(p[2]))
    return out
