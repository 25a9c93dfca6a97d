"""W3C trace context: one trace id from where a request enters to the workload it starts.

A `traceparent` (`00-<32 hex trace id>-<16 hex parent span id>-<2 hex flags>`) is created
where a request enters (an API call, `fleetline apply`) or taken from the caller, travels in
the `traceparent` Kafka header of every message it causes (the scheduler request, the
decisions, allocations and orders, the cluster agent's workload events, the audit record) and
is stored as `trace_id` beside each such row in ClickHouse. Processors derive their own span
ids from what they are handling (`child`), so a replay stamps the same headers.

Spans also go to an OpenTelemetry collector when `OTEL_EXPORTER_OTLP_ENDPOINT` is set
(`spans`); without it, nothing is exported and nothing is paid.
"""

from __future__ import annotations

import os
import re
import secrets
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from fleetline.observability.traceparent import (
    HEADER,
    TraceContext,
    derived_span_id,
    of_trace,
    parse,
)

__all__ = ["HEADER", "TraceContext", "derived_span_id", "of_trace", "parse"]


def start(incoming: str | None = None) -> TraceContext:
    """Where a request enters: a child of the caller's context, or a new trace."""
    parent = parse(incoming)
    span = secrets.token_hex(8)
    if parent is not None:
        return TraceContext(parent.trace_id, span, parent.sampled)
    return TraceContext(secrets.token_hex(16), span)


HeaderList = list[tuple[str, str | bytes | None]]


_TRACE_HEX = re.compile(rb"[0-9a-f]{32}")


def trace_id_in(
    headers: Sequence[tuple[str, str | bytes | None]] | Mapping[str, str | bytes | None] | None,
) -> str:
    """Only the trace id of a message's `traceparent` header ('' if none): what a sink stores
    beside each row, read without building a context (a sink's hot path)."""
    items = headers.items() if isinstance(headers, Mapping) else headers or ()
    for name, value in items:
        if name != HEADER:
            continue
        if (
            isinstance(value, bytes)
            and len(value) == 55
            and value[:3] == b"00-"
            and _TRACE_HEX.fullmatch(value, 3, 35)
            and value[3:35] != b"0" * 32
        ):
            return value[3:35].decode()
        context = parse(value)  # another version or spelling: the full parse
        return context.trace_id if context else ""
    return ""


def header(context: TraceContext | None) -> HeaderList:
    """The Kafka header carrying `context` (none for no context)."""
    return [] if context is None else [(HEADER, context.traceparent.encode())]


# -- OpenTelemetry spans (exported only when an OTLP endpoint is configured) ------------------

_tracer: Any = None
_provider: Any = None


def _otel_tracer() -> Any:
    """The OTLP-exporting tracer, or None when no endpoint is configured."""
    global _tracer, _provider
    if _tracer is not None or not os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        return _tracer
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    service = os.environ.get("OTEL_SERVICE_NAME", "fleetline")
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    _provider, _tracer = provider, provider.get_tracer("fleetline")
    return _tracer


@contextmanager
def span(
    name: str, context: TraceContext | None, attributes: Mapping[str, Any] | None = None
) -> Iterator[None]:
    """An OpenTelemetry span named `name`, a child of `context`, exported over OTLP when
    `OTEL_EXPORTER_OTLP_ENDPOINT` is set; otherwise nothing."""
    tracer = _otel_tracer() if context is not None else None
    if tracer is None:
        yield
        return
    from opentelemetry import trace as otel
    from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

    assert context is not None
    parent = SpanContext(
        int(context.trace_id, 16),
        int(context.span_id, 16),
        is_remote=True,
        trace_flags=TraceFlags(0x01 if context.sampled else 0x00),
    )
    with tracer.start_as_current_span(
        name,
        context=otel.set_span_in_context(NonRecordingSpan(parent)),
        attributes=dict(attributes or {}),
    ):
        yield


@contextmanager
def entered(
    name: str, incoming: str | None, attributes: Mapping[str, Any] | None = None
) -> Iterator[TraceContext]:
    """Where a request enters: the context of its span, a child of the caller's `incoming`
    traceparent or the root of a new trace. With an OTLP endpoint configured the span is
    exported and the context carries its ids, so what follows hangs under it."""
    parent = parse(incoming)
    tracer = _otel_tracer()
    if tracer is None:
        yield start(incoming)
        return
    from opentelemetry import trace as otel
    from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

    context = None
    if parent is not None:
        remote = SpanContext(
            int(parent.trace_id, 16),
            int(parent.span_id, 16),
            is_remote=True,
            trace_flags=TraceFlags(0x01 if parent.sampled else 0x00),
        )
        context = otel.set_span_in_context(NonRecordingSpan(remote))
    with tracer.start_as_current_span(
        name, context=context, attributes=dict(attributes or {})
    ) as current:
        ids = current.get_span_context()
        yield TraceContext(f"{ids.trace_id:032x}", f"{ids.span_id:016x}", ids.trace_flags.sampled)


def flush_spans(timeout_s: float = 5.0) -> None:
    """Export the spans still buffered (a process about to exit)."""
    if _provider is not None:
        _provider.force_flush(int(timeout_s * 1000))
