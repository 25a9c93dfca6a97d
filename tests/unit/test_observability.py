"""Trace context, Prometheus exposition, DCGM-named gauges and structured logs (no services)."""

from __future__ import annotations

import json
import logging

from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from fleetline.api.app import create_app
from fleetline.api.auth import AuthConfig, Authenticator, token_digest
from fleetline.observability import logs, metrics, tracing
from fleetline.processors.view.read import StaticView
from fleetline.processors.view.runtime import dcgm_readings
from tests.fleet_events import fold, scenario_events
from tests.support import Recorder
from tests.unit.test_api import SchedulerPort

SPEC = """
kind: TrainingJob
metadata: {name: train, tenant: acme}
spec: {accelerator: H100, gpus_per_worker: 8, workers: 1}
"""


def test_a_traceparent_is_parsed_continued_and_a_bad_one_replaced():
    incoming = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    parsed = tracing.parse(incoming)
    assert parsed is not None and parsed.trace_id == "4bf92f3577b34da6a3ce929d0e0e4736"
    continued = tracing.start(incoming)
    assert continued.trace_id == parsed.trace_id and continued.span_id != parsed.span_id
    for bad in ("", "junk", "00-" + "0" * 32 + "-00f067aa0ba902b7-01", "01-abc-def-01"):
        assert tracing.parse(bad) is None
        fresh = tracing.start(bad)
        assert len(fresh.trace_id) == 32 and tracing.parse(fresh.traceparent) == fresh
    # A processor's span ids are derived, so a replay stamps the same header.
    assert parsed.child("decision/7.0") == parsed.child("decision/7.0")
    assert parsed.child("decision/7.0") != parsed.child("decision/7.1")
    header = tracing.header(parsed.child("x"))
    assert tracing.trace_id_in(header) == parsed.trace_id
    assert tracing.parse(header[0][1]) == parsed.child("x") and tracing.header(None) == []


def _auth() -> Authenticator:
    return Authenticator(
        AuthConfig.from_data(
            {
                "tokens": [
                    {"name": "u", "sha256": token_digest("fl_u"), "role": "user", "tenant": "acme"}
                ]
            }
        )
    )


def test_an_api_submission_carries_its_trace_into_the_request_the_job_and_the_audit():
    port, recorder = SchedulerPort(), Recorder()
    client = TestClient(
        create_app(StaticView(fold([])), _auth(), recorder, jobs=port),
        headers={"Authorization": "Bearer fl_u"},
    )
    incoming = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    accepted = client.post("/v1/jobs", content=SPEC, headers={"traceparent": incoming})
    assert accepted.status_code == 202, accepted.text
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    assert accepted.json()["trace_id"] == trace_id
    assert tracing.parse(accepted.headers["traceparent"]).trace_id == trace_id
    (request,) = port.requests
    assert tracing.parse(request["traceparent"]).trace_id == trace_id
    assert port.job("acme/train")["entered_trace"] == trace_id
    (event,) = [e for e in recorder.events if e["operation"] == "api.POST /v1/jobs"]
    assert event["trace_id"] == trace_id
    # Without a traceparent a trace is started where the request enters.
    again = client.post("/v1/jobs", content=SPEC.replace("train", "other"))
    fresh = again.json()["trace_id"]
    assert len(fresh) == 32 and fresh != trace_id
    assert port.job("acme/other")["entered_trace"] == fresh


def _metrics(client: TestClient) -> dict[str, list]:
    response = client.get("/metrics")
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain")
    return {family.name: family.samples for family in text_string_to_metric_families(response.text)}


def test_metrics_are_prometheus_text_with_dcgm_gauges_equal_to_the_view():
    view = fold(scenario_events(seconds=5))
    source = StaticView(view)
    metrics.register_collector("dcgm", metrics.DcgmCollector(dcgm_readings(source)))
    app = create_app(source, _auth(), Recorder())
    anonymous = TestClient(app).get("/metrics")
    assert anonymous.status_code == 401  # the API's auth, like every route
    client = TestClient(app, headers={"Authorization": "Bearer fl_u"})
    client.get("/v1/clusters")
    families = _metrics(client)
    node = next(iter(view.nodes.values()))
    gpu = node.gpus[0]
    readings = gpu.readings()
    util = {
        (s.labels["Hostname"], s.labels["gpu"]): s.value for s in families["DCGM_FI_DEV_GPU_UTIL"]
    }
    assert util[(node.node_id, "0")] == readings["gpu_util_pct"]
    fb = {(s.labels["Hostname"], s.labels["gpu"]): s.value for s in families["DCGM_FI_DEV_FB_USED"]}
    assert fb[(node.node_id, "0")] == readings["fb_used_mib"]
    power = [s for s in families["DCGM_FI_DEV_POWER_USAGE"] if s.labels["UUID"] == gpu.uuid]
    assert power[0].value == readings["power_w"] and power[0].labels["cluster"] == node.cluster_id
    assert len(util) == sum(len(n.gpus) for n in view.nodes.values())
    assert "DCGM_FI_DEV_XID_ERRORS" in families
    calls = [
        s
        for s in families["fleetline_api_requests"]
        if s.name == "fleetline_api_requests_total" and s.labels["route"] == "/v1/clusters"
    ]
    assert calls and calls[0].labels["status"] == "200" and calls[0].value >= 1


def test_callback_collectors_read_their_source_at_scrape_time():
    registry = CollectorRegistry()
    spools = {
        "eu-1": {
            "records": 3,
            "bytes": 300,
            "dropped": 1,
            "unspooled": 2,
            "resent": 0,
            "rewinds": 0,
        }
    }
    status = {
        "passes": 17,
        "gpus_reserved": 8,
        "workloads": [{"job": "acme/t", "state": "Running", "step": 40}],
        "peers": [{"cluster_id": "us-1", "reachable": False, "rtt_ms": None}],
    }
    metrics.register_collector("spool", metrics.spool_collector(lambda: spools), registry)
    metrics.register_collector(
        "ca", metrics.cluster_agent_collector("eu-1", lambda: status), registry
    )
    spools["eu-1"]["records"] = 5  # read at scrape time, not at registration
    text = metrics.exposition(registry)[0].decode()
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }
    assert samples[("fleetline_agent_spool_depth", (("cluster", "eu-1"),))] == 5
    assert samples[("fleetline_agent_spool_dropped", (("cluster", "eu-1"),))] == 1
    assert samples[("fleetline_agent_spool_unspooled", (("cluster", "eu-1"),))] == 2
    assert samples[("fleetline_cluster_agent_gpus_reserved", (("cluster", "eu-1"),))] == 8
    assert samples[("fleetline_cluster_agent_loop_passes", (("cluster", "eu-1"),))] == 17
    assert (
        samples[("fleetline_cluster_agent_workloads", (("cluster", "eu-1"), ("state", "Running")))]
        == 1
    )
    assert (
        samples[("fleetline_cluster_agent_peer_reachable", (("cluster", "eu-1"), ("peer", "us-1")))]
        == 0
    )


def test_consumer_lag_comes_from_librdkafka_statistics():
    on_statistics = metrics.consumer_statistics("g-test")
    on_statistics(
        json.dumps(
            {
                "topics": {
                    "t": {
                        "partitions": {
                            "0": {"consumer_lag": 42},
                            "1": {"consumer_lag": -1},
                            "-1": {"consumer_lag": 7},
                        }
                    }
                }
            }
        )
    )
    on_statistics("not json")  # ignored, not raised
    assert metrics.CONSUMER_LAG.labels("g-test", "t", "0")._value.get() == 42
    text = metrics.exposition()[0].decode()
    assert 'fleetline_consumer_lag{group="g-test",partition="1",topic="t"}' not in text


def test_json_log_lines_carry_the_trace_id_and_their_fields():
    formatter = logs.JsonFormatter("serve/0")
    record = logging.LogRecord(
        "fleetline.x", logging.WARNING, __file__, 1, "hello %s", ("w",), None
    )
    record.job = "acme/t"
    with logs.traced("4bf92f3577b34da6a3ce929d0e0e4736"):
        line = json.loads(formatter.format(record))
    assert line["message"] == "hello w" and line["level"] == "WARNING"
    assert line["trace_id"] == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert line["process"] == "serve/0" and line["job"] == "acme/t"
    assert json.loads(formatter.format(record))["trace_id"] == ""


def test_a_sink_reads_the_trace_id_of_any_valid_traceparent_and_nothing_else():
    context = tracing.start()
    assert tracing.trace_id_in(tracing.header(context)) == context.trace_id
    upper = [("traceparent", context.traceparent.upper().replace("00-", "00-", 1).encode())]
    assert tracing.trace_id_in(upper) == context.trace_id  # the full parse takes it
    for bad in (b"00-" + b"0" * 32 + b"-00f067aa0ba902b7-01", b"garbage", None):
        assert tracing.trace_id_in([("traceparent", bad)]) == ""
    assert tracing.trace_id_in([("other", b"x")]) == "" and tracing.trace_id_in(None) == ""


def test_what_an_api_call_logs_carries_the_call_s_trace_id():
    lines: list[dict] = []

    class Capture(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(json.loads(logs.JsonFormatter("serve/0").format(record)))

    handler = Capture(logging.WARNING)
    logging.getLogger("fleetline.api").addHandler(handler)
    try:
        client = TestClient(create_app(StaticView(fold([])), _auth(), Recorder()))
        trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
        refused = client.get(
            "/v1/clusters", headers={"traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"}
        )
    finally:
        logging.getLogger("fleetline.api").removeHandler(handler)
    assert refused.status_code == 401
    (line,) = [line for line in lines if line["message"].startswith("refused GET /v1/clusters")]
    assert line["trace_id"] == trace_id
