"""Console benchmark: how long the operators' console takes to show its main page (the fleet)
with 80,000 GPUs in the view, measured in Debian's Chromium (headless, driven by Playwright).

Folds `--nodes` simulated 8-GPU nodes (default 10,000 = 80,000 GPUs, four clusters, with a few
GPUs degraded) into a view, serves the API and the console over it with uvicorn on loopback,
signs in and opens the page `--runs` times. "Render" is the browser's own clock from the start
of navigation to the page's content being in the document (the API calls it makes included);
the API's answer times for the page's calls are measured beside it. Target: under 1 s.

    .venv/bin/python benchmarks/console.py [--nodes 10000] [--runs 5]
"""

from __future__ import annotations

import argparse
import socket
import statistics
import threading
import time
from urllib.request import Request, urlopen

import uvicorn
from _common import fold_telemetry_records, report
from playwright.sync_api import sync_playwright

from fleetline.agents.simulator import ClusterSpec, Fault, FleetSimulator
from fleetline.api.app import create_app
from fleetline.api.auth import AuthConfig, Authenticator, token_digest
from fleetline.processors.view.model import ResourceView
from fleetline.processors.view.read import StaticView, cluster_capacity

BASE_MS = 1_796_000_000_000
TOKEN = "fl_bench_console"
TARGET_MS = 1000.0


class Discard:
    def emit(self, event: dict) -> None:
        pass


def fleet_view(nodes: int) -> ResourceView:
    per = nodes // 4
    sim = FleetSimulator([ClusterSpec(f"c{i}", f"region-{i}", per) for i in range(4)], seed=1)
    for n in range(0, 400, 40):  # some sick GPUs for the page's list
        sim.add_fault(Fault("xid", f"{sim.nodes[n].node_id}/{n % 8}", BASE_MS, None, 79))
    view = ResourceView()
    for tick in range(3):
        fold_telemetry_records(view, sim.telemetry(BASE_MS + tick * 1000))
    return view


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=10_000)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    began = time.perf_counter()
    view = fleet_view(args.nodes)
    gpus = sum(c["gpus"] for c in cluster_capacity(view))
    figures: dict[str, object] = {
        "gpus_in_view": gpus,
        "build_view_s": time.perf_counter() - began,
    }
    auth = AuthConfig.from_data(
        {"tokens": [{"name": "b", "sha256": token_digest(TOKEN), "role": "platform-admin"}]}
    )
    app = create_app(StaticView(view), Authenticator(auth), Discard())
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    base = f"http://127.0.0.1:{port}"

    def api_ms(path: str) -> float:
        request = Request(base + path, headers={"Authorization": f"Bearer {TOKEN}"})
        start = time.perf_counter()
        with urlopen(request) as response:
            response.read()
        return (time.perf_counter() - start) * 1000

    for path in ("/v1/clusters", "/v1/gpus?health=degraded", "/v1/gpus?health=failed"):
        api_ms(path)  # warm
        figures[f"api_ms {path}"] = statistics.median(api_ms(path) for _ in range(5))

    renders, walls, heatmaps = [], [], []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path="/usr/bin/chromium", headless=True, args=["--no-sandbox"]
        )
        context = browser.new_context(viewport={"width": 1400, "height": 900})
        context.add_init_script(f"sessionStorage.setItem('fleetline.token', '{TOKEN}')")
        errors: list[str] = []
        for run in range(args.runs + 1):  # the first load warms the browser's cache
            # A fresh page (tab) each time: a full load, not a hash change.
            page = context.new_page()
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            start = time.perf_counter()
            page.goto(f"{base}/ui/#/fleet")
            page.wait_for_selector('#page[data-page="fleet"]', timeout=30_000)
            wall = (time.perf_counter() - start) * 1000
            rendered = page.evaluate("Number(document.querySelector('#page').dataset.rendered)")
            origin = page.evaluate("performance.timeOrigin")
            if run:
                renders.append(rendered - origin)
                walls.append(wall)
            if run < args.runs:
                page.close()
        shown = int(page.get_by_test_id("fleet-total-gpus").inner_text())
        assert shown == gpus, (shown, gpus)
        for _ in range(2):  # one cluster's heatmap: a quarter of the fleet, one cell a GPU
            start = time.perf_counter()
            page.goto(f"{base}/ui/#/cluster/c0")
            page.wait_for_selector('#page[data-page="cluster"]', timeout=60_000)
            heatmaps.append((time.perf_counter() - start) * 1000)
        browser.close()
    server.should_exit = True
    figures["fleet_page_render_ms_median"] = statistics.median(renders)
    figures["fleet_page_render_ms_max"] = max(renders)
    figures["fleet_page_wall_ms_median"] = statistics.median(walls)
    figures["fleet_page_target_ms"] = TARGET_MS
    figures["fleet_page_meets_target"] = max(renders) < TARGET_MS
    figures["cluster_heatmap_gpus"] = gpus // 4
    figures["cluster_heatmap_wall_ms_median"] = statistics.median(heatmaps)
    figures["browser_console_errors"] = len(errors)
    report("console", figures)


if __name__ == "__main__":
    main()
