"""The README's performance table, made again from the benchmarks' last runs.

Reads `benchmarks/results/peers.runs.jsonl`, `scheduler.runs.jsonl`,
`cluster_control.runs.jsonl`, `view.runs.jsonl` and `postmortem.runs.jsonl` (what `report`
keeps of every run), tells each figure as the range of the last three runs, and writes the
table between the README's `<!-- performance table -->` markers. Run after `make bench-peers`
(which runs it), `benchmarks/scheduler.py`, `benchmarks/cluster_control.py`,
`benchmarks/view.py` or `benchmarks/postmortem.py`.

    .venv/bin/python benchmarks/readme_table.py [--runs 3]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from _common import recent_runs

README = Path(__file__).resolve().parent.parent / "README.md"
START, END = "<!-- performance table -->", "<!-- end of performance table -->"
SYSTEMS = ("fleetline", "slurm", "kubernetes")


def span(values: list[Any], unit: str = "", fmt: Callable[[float], str] = "{:,.0f}".format) -> str:
    """'12-15 unit' over the runs ('-' where a system cannot say)."""
    known = [v for v in values if v is not None]
    if not known:
        return "-"
    low, high = min(known), max(known)
    text = fmt(low) if low == high else f"{fmt(low)}-{fmt(high)}"
    return f"{text}{unit}"


def share(values: list[Any]) -> str:
    return span([v * 100 if v is not None else None for v in values], " %")


def table(
    peers: list[dict[str, Any]],
    core: list[dict[str, Any]],
    restore: list[dict[str, Any]],
    rebuilds: Sequence[dict[str, Any]] = (),
    tails: Sequence[dict[str, Any]] = (),
    postmortems: Sequence[dict[str, Any]] = (),
) -> str:
    last = peers[-1]
    rows: list[tuple[str, Callable[[str], str]]] = []

    def figure(name: str, render: Callable[[list[Any]], str] = span) -> Callable[[str], str]:
        return lambda system: render([run.get(f"{system}_{name}") for run in peers])

    def two(a: str, b: str, unit: str) -> Callable[[str], str]:
        return lambda system: (
            f"{figure(a)(system)} / {figure(b)(system)}{unit}" if figure(a)(system) != "-" else "-"
        )

    fits = f"{last['fits_jobs']} jobs asking {last['fits_gpus_asked']} of {last['gpus']} GPUs"
    contended = (
        f"{last['contended_jobs']} jobs asking {last['contended_gpus_asked']} of {last['gpus']}"
    )
    rows = [
        (f"burst that fits ({fits}): jobs started per second", figure("fits_jobs_per_s")),
        ("... submit to start, p50 / p99", two("fits_submit_to_start_p50_ms",
                                                "fits_submit_to_start_p99_ms", " ms")),
        ("... jobs started whole", figure("fits_jobs_started")),
        ("... tensor-parallel groups inside one NVLink island",
         figure("fits_tp_groups_in_one_nvlink_island", share)),
        ("... multi-node pipelines under one leaf switch",
         figure("fits_pipelines_under_one_leaf", share)),
        (f"contended ({contended}): GPUs held by whole gangs",
         figure("contended_gpus_in_whole_gangs")),
        ("... multi-node pipelines under one leaf switch",
         figure("contended_pipelines_under_one_leaf", share)),
        ("... jobs holding GPUs with part of their gang pending",
         figure("contended_jobs_started_in_part")),
        ("... GPUs asked at high / low priority that started",
         lambda system: f"{figure('contended_high_priority_gpus_started_share', share)(system)}"
         f" / {figure('contended_low_priority_gpus_started_share', share)(system)}"),
    ]  # fmt: skip
    header = (
        "| figure (ranges over the last "
        f"{len(peers)} runs of `make bench-peers`, {last['machine']}) | fleetline | "
        "Slurm 22.05 | Kubernetes 1.37 scheduler |\n| --- | --- | --- | --- |\n"
    )
    body = "".join(
        f"| {label} | " + " | ".join(render(s) for s in SYSTEMS) + " |\n" for label, render in rows
    )
    if core:
        rate = span([r.get("core_requests_per_s") for r in core], "/s")
        p99 = span([r.get("core_latency_p99_ms") for r in core], " ms", "{:.1f}".format)
        same = all(r.get("decisions_as_baseline") for r in core)
        body += (
            f"| scheduler core alone, {core[-1]['gpus']:,} GPUs, {core[-1]['requests']:,} "
            f"requests (`benchmarks/scheduler.py`; target 2,000/s, p99 < 10 ms) | {rate}, "
            f"p99 {p99}{'' if same else ' (decisions differ from the baseline)'} | - | - |\n"
        )
    if restore:
        ratio = span([r.get("sealed_restore_vs_raw_get") for r in restore], "x", "{:.2f}".format)
        speed = span([r.get("sealed_restore_mb_s (digests or tags verified)") for r in restore])
        peak = span([r.get("file_peak_python_memory_mb") for r in restore], " MiB")
        body += (
            f"| sealed checkpoint restore, {restore[-1]['checkpoint_mb']:.0f} MiB in 4 parts, "
            "vs a raw S3 GET of the same bytes (`benchmarks/cluster_control.py`, medians of "
            f"{restore[-1]['rounds (medians)']} rounds; target 0.8x) | {ratio} ({speed} MB/s); "
            f"a {restore[-1]['file_checkpoint_mb (sealed, one part)']} MiB part saved from and "
            f"restored to a file holds at most {peak} | - | - |\n"
        )
    if rebuilds:
        seconds = span([r.get("rebuild_from_log_s") for r in rebuilds], " s", "{:.1f}".format)
        tail = (
            "; from a snapshot at 90 % + the tail, "
            f"{tails[-1]['events'] / 1e6:.2f} M events: "
            + span(
                [r.get("rebuild_with_snapshot_at_90pct_s") for r in tails], " s", "{:.1f}".format
            )
            + " (target 5 s)"
            if tails
            else ""
        )
        body += (
            f"| view rebuild from the log, {rebuilds[-1]['events'] / 1e6:.0f} M events "
            f"({rebuilds[-1]['gpu_samples'] / 1e6:.0f} M GPU samples), no snapshot "
            f"(`benchmarks/view.py --ticks 1000`, {rebuilds[-1]['rebuild_workers']} processes; "
            f"target 60 s) | {seconds}{tail} | - | - |\n"
        )
    if postmortems:
        made = span([r.get("postmortem_s") for r in postmortems], " s", "{:.1f}".format)
        rate = span([r.get("what_if_unchanged_decisions_per_s") for r in postmortems], "/s")
        p99 = span([r.get("fit_alone_p99_ms") for r in postmortems], " ms", "{:.0f}".format)
        body += (
            "| postmortem of 1 hour of 80,000 GPUs (28.8 M samples; target 60 s); what-if replay "
            "of the 10,000-job log (target 1,000 decisions/s); what would make a queued job fit, "
            f"p99 (target 100 ms) (`benchmarks/postmortem.py`) | {made}; {rate}; {p99} | - | - |\n"
        )
    return header + body


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    # The sizes the README speaks of: the scripts' defaults.
    peers = recent_runs("peers", args.runs, nodes=32, nodes_per_leaf=8)
    if not peers:
        raise SystemExit("no default-size run of benchmarks/peers.py here: `make bench-peers`")
    text = README.read_text()
    if START not in text or END not in text:
        raise SystemExit(f"README.md has no {START} ... {END} block")
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    made = table(
        peers,
        recent_runs("scheduler", args.runs, nodes=10_000, requests=10_010),
        # Runs that took medians (since the checkpoint figures are measured that way).
        recent_runs("cluster_control", args.runs, checkpoint_mb=64.0, **{"rounds (medians)": 5}),
        # Runs since the rebuild folds in several processes (which they record).
        [r for r in recent_runs("view", 50, nodes=10_000, ticks=1000) if "rebuild_workers" in r][
            -args.runs :
        ],
        [r for r in recent_runs("view", 50, nodes=10_000, ticks=125) if "rebuild_workers" in r][
            -args.runs :
        ],
        recent_runs("postmortem", args.runs, postmortem_gpus=80_000, what_if_decisions=18_866),
    )
    README.write_text(f"{head}{START}\n{made}{END}{tail}")
    print(made)


if __name__ == "__main__":
    main()
