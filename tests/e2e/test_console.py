"""The operators' console in a real browser: Debian's Chromium, headless, driven by Playwright,
against the running stack (`tests/stack.py`: the serve services, a simulated fleet, one cluster
agent process per cluster, the API on a free port).

Every page loads without a console error and is screenshotted into tests/results/console/;
the numbers on the fleet page equal the API's; a fault injected into the simulator shows on
the open page within seconds without a reload; a job's page draws its loss curve from the
cluster agents' reports; a tenant's user sees only the tenant's jobs; the Incident page tells
an injected fault, and the postmortem's HTML renders from disk with nothing fetched.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.request import Request, urlopen

import pytest
import uvicorn
from playwright.sync_api import ConsoleMessage, Page

from fleetline.agents.simulator import Fault
from fleetline.api.auth import AuthConfig, Authenticator, token_digest
from fleetline.app import Options
from fleetline.config import Settings
from fleetline.processors.audit.runtime import KafkaAuditEmitter
from fleetline.processors.health.fold import ClusterHealthPolicy
from fleetline.processors.scheduling.client import submit
from tests.services import submits
from tests.stack import Stack, now_ms, running_stack
from tests.support import wait_until

RESULTS = Path(__file__).resolve().parents[1] / "results" / "console"
CLUSTERS = ("ca", "cb")
TOKENS = {
    "admin": ("platform-admin", None),
    "acme": ("user", "acme"),
    "globex": ("user", "globex"),
}


def token(name: str) -> str:
    return f"fl_console_{name}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Console:
    """The stack, its API served on a port, and a way to ask the API what a page should show."""

    def __init__(self, stack: Stack, url: str) -> None:
        self.stack = stack
        self.url = url

    def post(self, who: str, path: str, body: Any) -> Any:
        request = Request(
            f"{self.url}{path}",
            data=json.dumps(body).encode(),
            headers={"Authorization": f"Bearer {token(who)}", "Content-Type": "application/json"},
        )
        with urlopen(request, timeout=30) as response:
            return json.loads(response.read())

    def api(self, who: str, path: str) -> Any:
        request = Request(f"{self.url}{path}", headers={"Authorization": f"Bearer {token(who)}"})
        with urlopen(request, timeout=30) as response:
            return json.loads(response.read())


def training(name: str, tenant: str, steps: int) -> dict[str, Any]:
    return {
        "kind": "TrainingJob",
        "metadata": {"name": name, "tenant": tenant},
        "spec": {
            "accelerator": "H100",
            "gpus_per_worker": 2,
            "workers": 1,
            "checkpoint_interval_s": 60,
            "workload": {"steps": steps, "checkpoint_every_steps": 100, "step_delay_ms": 50},
        },
    }


@pytest.fixture(scope="module")
def console(services: Settings) -> Iterator[Console]:
    options = Options(
        tick_interval_s=0.3,
        clock_interval_s=0.25,
        health_policy=ClusterHealthPolicy(suspect_after_ms=3_000, lost_after_ms=8_000),
    )
    with running_stack(services, CLUSTERS, options, "console") as stack:
        auth = AuthConfig.from_data(
            {
                "tokens": [
                    {"name": name, "sha256": token_digest(token(name)), "role": r, "tenant": t}
                    for name, (r, t) in TOKENS.items()
                ]
            }
        )
        stack.fleet.register_metrics()
        emitter = KafkaAuditEmitter(stack.settings.kafka, stack.topics)
        app = stack.fleet.api(Authenticator(auth), emitter)
        port = free_port()
        server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning")
        )
        serving = threading.Thread(target=server.run, daemon=True)
        serving.start()
        wait_until(lambda: server.started, 30, "the API to listen")
        console = Console(stack, f"http://127.0.0.1:{port}")
        # acme's job enters through the API, as a user's would: its trace starts there.
        console.post("acme", "/v1/jobs", training("train", "acme", 4000))
        submit(
            stack.settings.kafka,
            stack.topics,
            submits(
                training("secret", "globex", 4000),
                {
                    "kind": "InferenceService",
                    "metadata": {"name": "chat", "tenant": "acme"},
                    "spec": {
                        "model": "llama",
                        "accelerator": "H100",
                        "gpus_per_replica": 1,
                        "replicas": {"min": 1, "max": 2},
                        "latency_target_ms": 200,
                        "regions": ["region-ca", "region-cb"],
                    },
                },
            ),
        )
        RESULTS.mkdir(parents=True, exist_ok=True)
        try:
            yield console
        finally:
            server.should_exit = True
            serving.join(15)
            emitter.flush()


class Session:
    """A signed-in page that records every console error and failed request."""

    def __init__(self, page: Page) -> None:
        self.page = page
        self.errors: list[str] = []
        page.on("console", self._console)
        page.on("pageerror", lambda exc: self.errors.append(f"page error: {exc}"))

    def _console(self, message: ConsoleMessage) -> None:
        if message.type == "error":
            self.errors.append(message.text)

    def open(self, console: Console, hash_route: str) -> None:
        self.page.goto(f"{console.url}/ui/#/{hash_route}")
        self.wait_rendered(hash_route.split("/")[0])

    def wait_rendered(self, page_name: str) -> None:
        self.page.wait_for_selector(f'#page[data-page="{page_name}"]', timeout=20_000)

    def text(self, testid: str) -> str:
        return self.page.get_by_test_id(testid).first.inner_text().strip()


@pytest.fixture
def signed_in(console: Console, browser: Any) -> Iterator[Any]:
    contexts = []

    def sign_in(who: str) -> Session:
        context = browser.new_context(viewport={"width": 1400, "height": 900})
        contexts.append(context)
        session = Session(context.new_page())
        session.page.goto(f"{console.url}/ui/")
        session.page.fill("#token", token(who))
        session.page.click("#login button[type=submit]")
        session.wait_rendered("fleet")
        return session

    yield sign_in
    for context in contexts:
        context.close()


def job_running(console: Console, key: str) -> bool:
    job = console.stack.job(key)
    return job is not None and job["phase"] == "Running" and job["checkpoint_step"] is not None


def test_every_page_loads_without_errors_and_is_screenshotted(console, signed_in):
    wait_until(lambda: job_running(console, "acme/train"), 90, "acme/train to checkpoint")
    session = signed_in("admin")
    pages = [
        ("fleet", "fleet"),
        ("cluster/ca", "cluster"),
        ("jobs", "jobs"),
        ("job/acme/train", "job"),
        ("services", "services"),
        ("tickets", "tickets"),
        ("history", "history"),
        ("audit", "audit"),
        ("incident", "incident"),
        ("logs", "logs"),
    ]
    for hash_route, name in pages:
        session.open(console, hash_route)
        assert not session.page.get_by_test_id("page-error").count(), hash_route
        session.page.screenshot(path=str(RESULTS / f"{name}.png"), full_page=True)
    assert session.errors == []
    # The heatmap draws every GPU of the cluster, laid out under its node.
    session.open(console, "cluster/ca")
    gpus = console.api("admin", "/v1/gpus?cluster=ca")["items"]
    assert session.page.locator("[data-testid^='gpu-ca-']").count() == len(gpus) > 0


def test_the_fleet_page_shows_the_api_s_numbers(console, signed_in):
    session = signed_in("admin")
    fields = ("gpus", "idle", "allocated", "degraded", "failed", "unavailable")

    def same() -> bool:
        session.page.reload()
        session.wait_rendered("fleet")
        clusters = console.api("admin", "/v1/clusters")["items"]
        shown = {
            (c["cluster_id"], f): int(session.text(f"cluster-{c['cluster_id']}-{f}"))
            for c in clusters
            for f in fields
        }
        wanted = {(c["cluster_id"], f): c[f] for c in clusters for f in fields}
        totals = {f: int(session.text(f"fleet-total-{f}")) for f in fields}
        return shown == wanted and totals == {f: sum(c[f] for c in clusters) for f in fields}

    # The fleet moves (jobs start, finish): the page and the API agree at one moment.
    wait_until(same, 30, "the page and the API to agree", every_s=1)
    assert session.errors == []


def test_a_fault_in_the_simulator_shows_on_the_open_page_within_seconds(console, signed_in):
    session = signed_in("admin")
    node = next(n.node_id for n in console.stack.simulator.nodes if n.cluster_id == "cb")
    session.page.evaluate("window.__sameDocument = true")
    before = int(session.text("cluster-cb-failed"))
    injected = time.monotonic()
    console.stack.simulator.add_fault(Fault("xid", f"{node}/5", now_ms(), None, 79))
    row = session.page.get_by_test_id(f"sick-{node}-5")
    row.wait_for(timeout=15_000)
    shown_after_s = time.monotonic() - injected
    assert "xid 79" in row.inner_text()
    wait_until(lambda: int(session.text("cluster-cb-failed")) == before + 1, 15, "the count")
    # Updated in place, by the event stream: the document was never reloaded.
    assert session.page.evaluate("window.__sameDocument") is True
    assert shown_after_s < 10, shown_after_s
    print(f"the XID showed on the open page {shown_after_s:.1f} s after it was injected")
    # Self-healing opened a ticket for the node; the Tickets page lists it with the API's state.
    wait_until(
        lambda: any(t["node_id"] == node for t in console.api("admin", "/v1/tickets")["tickets"]),
        20,
        "a ticket for the node",
    )
    session.open(console, "tickets")
    assert session.text(f"ticket-state-{node}") == "OPEN"
    assert "xid 79" in session.page.get_by_test_id(f"ticket-{node}").inner_text()
    assert session.errors == []


def test_a_job_page_draws_the_loss_curve_and_the_checkpoints(console, signed_in):
    wait_until(lambda: job_running(console, "acme/train"), 90, "acme/train to checkpoint")
    session = signed_in("acme")

    def reported() -> bool:
        session.open(console, "job/acme/train")
        return session.page.get_by_test_id("loss-chart").count() == 1

    wait_until(reported, 60, "progress reports in ClickHouse", every_s=1)
    chart = session.page.get_by_test_id("loss-chart")
    assert int(chart.get_attribute("data-points") or 0) >= 2
    assert session.page.locator("#loss canvas").count() == 1
    progress = console.api("acme", "/v1/jobs/acme/train/progress")
    assert progress["rows"]
    job = console.api("acme", "/v1/jobs/acme/train")
    assert session.text("actual") == job["actual"]["state"]
    # The trace starts where the job entered, the API, and reaches the cluster agent.
    assert session.text("trace-id") == job["trace_id"]
    trace = session.text("trace")
    hops = ("api.POST /v1/jobs", "decision PLACED", "STARTING", "RUNNING")
    at = [trace.find(hop) for hop in hops]
    assert -1 not in at and at == sorted(at), trace
    assert session.errors == []


def test_a_tenant_s_user_sees_only_the_tenant_s_jobs(console, signed_in):
    wait_until(lambda: console.stack.job("globex/secret") is not None, 30, "globex's job")
    session = signed_in("acme")
    session.open(console, "jobs")
    keys = {
        row.get_attribute("data-testid").removeprefix("job-")
        for row in session.page.locator("table[data-testid='jobs'] tr[data-testid^='job-']").all()
    }
    assert keys == {j["key"] for j in console.api("acme", "/v1/jobs")["items"]}
    assert "acme/train" in keys and not any(k.startswith("globex/") for k in keys)
    assert "globex" not in session.page.content()
    # Another tenant's job page is refused by the API, and says so.
    session.page.goto(f"{console.url}/ui/#/job/globex/secret")
    session.page.get_by_test_id("page-error").wait_for(timeout=10_000)
    assert "403" in session.text("page-error")
    # The heatmap names no other tenant's job on a GPU.
    session.open(console, "cluster/ca")
    assert "globex" not in session.page.content()
    # The Audit and Logs pages are not offered to a user.
    assert session.page.locator("nav a[data-page='audit']").is_hidden()
    assert session.page.locator("nav a[data-page='logs']").is_hidden()
    # The 403 was logged by the browser as a failed resource load; nothing else was.
    assert session.errors and all("403" in e for e in session.errors), session.errors


def test_serve_s_metrics_have_the_loops_series_and_dcgm_gauges_equal_to_the_view(console):
    """`/metrics` of the running services: valid Prometheus text with the stream loops'
    series, the scheduler's and the API's, and GPU gauges under DCGM names that equal the
    view's readings of the same moment."""
    from prometheus_client.parser import text_string_to_metric_families

    def power(view) -> dict:
        return {
            (node.node_id, i): gpu.readings()["power_w"]
            for node in view.nodes.values()
            for i, gpu in node.gpus.items()
        }

    wait_until(lambda: console.stack.job("acme/train") is not None, 30, "a decision")
    auth = {"Authorization": f"Bearer {token('admin')}"}
    before = console.stack.fleet.view.read(power)
    with urlopen(Request(f"{console.url}/metrics", headers=auth), timeout=30) as response:
        text = response.read().decode()
    after = console.stack.fleet.view.read(power)
    families = {f.name: f for f in text_string_to_metric_families(text)}
    prefix = console.stack.topics.prefix
    messages = {
        s.labels["loop"]: s.value
        for s in families["fleetline_stream_messages"].samples
        if s.name.endswith("_total")
    }
    assert messages[f"{prefix}.resource-view"] > 0
    assert messages[f"{prefix}.hot-sink"] > 0
    rows = {s.labels["sink"] for s in families["fleetline_sink_rows"].samples}
    assert {"gpu_samples", "DecisionTable", "WorkloadEventTable"} <= rows
    assert any(s.value >= 1 for s in families["fleetline_scheduler_decisions"].samples)
    assert families["fleetline_scheduler_decision_seconds"].samples
    assert families["fleetline_api_requests"].samples

    # Consumer lag comes from librdkafka's statistics, every 5 s, for each loop's group.
    def lag_groups() -> set[str]:
        with urlopen(Request(f"{console.url}/metrics", headers=auth), timeout=30) as response:
            scraped = text_string_to_metric_families(response.read().decode())
        lag = next(f for f in scraped if f.name == "fleetline_consumer_lag")
        return {s.labels["group"] for s in lag.samples}

    groups = {f"{prefix}.hot-sink", f"{prefix}.resource-view", f"{prefix}.decisions-sink"}
    wait_until(lambda: groups <= lag_groups(), 30, "every loop's consumer lag", every_s=1)
    # The GPU gauges are the view's at scrape time: each equals the reading just before the
    # scrape or the one just after (a sample may land in between).
    shown = {
        (s.labels["Hostname"], int(s.labels["gpu"])): s.value
        for s in families["DCGM_FI_DEV_POWER_USAGE"].samples
    }
    assert set(shown) == set(before) and len(shown) == 16
    assert all(shown[k] in (before[k], after[k]) for k in shown), (shown, before, after)


def test_the_incident_page_and_the_postmortem_s_html_tell_an_injected_fault(console, signed_in):
    """(Last: the fault drains a node the other tests' jobs may run on.) A GPU falls off the
    bus; the postmortem of the last minutes names it with its detection
    and the verified audit chain, on the console's Incident page and in the self-contained
    HTML file, which Chromium renders from disk with no request beyond the file."""
    node = next(n.node_id for n in console.stack.simulator.nodes if n.cluster_id == "ca")
    since = now_ms() - 600_000
    console.stack.simulator.add_fault(Fault("xid", f"{node}/6", now_ms(), None, 79))
    wait_until(
        lambda: any(
            t["node_id"] == node and t["rule"] == "gpu_failed"
            for t in console.api("admin", "/v1/tickets")["tickets"]
        ),
        30,
        "the rule to open a ticket for the GPU",
    )
    window = f"/v1/postmortem?from={since}&to={now_ms() + 1000}"
    found: dict[str, Any] = {}

    def reported() -> bool:
        report = console.api("admin", window)
        found.update({f"{f['kind']} {f['subject']}": f for f in report["faults"]})
        found["report"] = report
        return f"xid {node}/6" in found  # once the sink has stored the samples

    wait_until(reported, 60, "the fault in the postmortem", every_s=1)
    fault = found[f"xid {node}/6"]
    assert fault["detected_ms"] is not None and fault["detection_s"] >= 0, fault
    assert node in fault["detected_by"] or "gpu_failed" in fault["detected_by"], fault
    assert found["report"]["audit"]["ok"] and found["report"]["audit"]["window_links"] > 0
    session = signed_in("admin")
    session.open(console, "incident")
    assert "audit chain verified" in session.text("incident-audit")
    session.page.get_by_test_id(f"fault-xid-{node}/6").wait_for(timeout=10_000)
    session.page.screenshot(path=str(RESULTS / "incident.png"), full_page=True)
    assert session.errors == []
    # The HTML a ticket links to: plots inline, readable offline.
    request = Request(
        f"{console.url}{window}&format=html", headers={"Authorization": f"Bearer {token('admin')}"}
    )
    with urlopen(request, timeout=60) as response:
        html = response.read().decode()
    saved = RESULTS / "postmortem.html"
    saved.write_text(html)
    page = session.page.context.new_page()
    fetched: list[str] = []
    page.on("request", lambda r: fetched.append(r.url))
    page.goto(saved.as_uri())
    assert page.locator("svg").count() >= 2
    assert "Faults and their detection" in page.content() and f"{node}/6" in page.content()
    assert page.locator("polyline").count() >= 1
    page.screenshot(path=str(RESULTS / "postmortem-html.png"), full_page=True)
    assert fetched == [saved.as_uri()], fetched
    page.close()
