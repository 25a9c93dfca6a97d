"""Spans leave over OTLP/HTTP when an endpoint is configured: a loopback receiver in this test
gets the API call's span, in the trace the caller's traceparent named."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

from fastapi.testclient import TestClient
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from fleetline.api.app import create_app
from fleetline.api.auth import AuthConfig, Authenticator, token_digest
from fleetline.observability import tracing
from fleetline.processors.view.read import StaticView
from tests.fleet_events import fold
from tests.support import Recorder, wait_until


def test_api_spans_are_exported_over_otlp_in_the_caller_s_trace(monkeypatch):
    received: list[bytes] = []

    class Receiver(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            received.append(self.rfile.read(int(self.headers["Content-Length"])))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), Receiver)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{server.server_port}")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "fleetline-test")
    monkeypatch.setattr(tracing, "_tracer", None)
    monkeypatch.setattr(tracing, "_provider", None)
    try:
        auth = AuthConfig.from_data(
            {
                "tokens": [
                    {"name": "u", "sha256": token_digest("fl_u"), "role": "user", "tenant": "a"}
                ]
            }
        )
        client = TestClient(
            create_app(StaticView(fold([])), Authenticator(auth), Recorder()),
            headers={"Authorization": "Bearer fl_u"},
        )
        trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
        response = client.get(
            "/v1/clusters", headers={"traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"}
        )
        assert response.status_code == 200
        tracing.flush_spans()
        wait_until(lambda: received, 10, "an OTLP export")
    finally:
        server.shutdown()
    spans = [
        span
        for body in received
        for resource in ExportTraceServiceRequest.FromString(body).resource_spans
        for scope in resource.scope_spans
        for span in scope.spans
    ]
    (span,) = [s for s in spans if s.name == "GET /v1/clusters"]
    assert span.trace_id.hex() == trace_id
    assert span.parent_span_id.hex() == "00f067aa0ba902b7"
