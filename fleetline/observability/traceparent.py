"""The W3C `traceparent` as data: reading one, and deriving the span ids a processor stamps on
what it emits from what it handles (pure: no clock, no randomness, so a replay derives the same
ids; starting a trace and exporting spans are in `tracing.py`)."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

HEADER = "traceparent"
_TRACEPARENT = re.compile(r"^00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")
_ZERO_TRACE = "0" * 32
_ZERO_SPAN = "0" * 16


@dataclass(frozen=True)
class TraceContext:
    trace_id: str
    span_id: str
    sampled: bool = True

    @property
    def traceparent(self) -> str:
        return f"00-{self.trace_id}-{self.span_id}-{'01' if self.sampled else '00'}"

    def child(self, seed: str) -> TraceContext:
        """The context of a span this one causes, its id derived from `seed` (what is being
        handled: a decision id, a workload event), so a replay derives the same one."""
        return TraceContext(self.trace_id, derived_span_id(self.trace_id, seed), self.sampled)


def derived_span_id(trace_id: str, seed: str) -> str:
    span = hashlib.sha256(f"{trace_id}/{seed}".encode()).hexdigest()[:16]
    return span if span != _ZERO_SPAN else "1".rjust(16, "0")


def parse(traceparent: str | bytes | None) -> TraceContext | None:
    """The context a `traceparent` value carries, or None when it is absent or not valid
    (an invalid one is ignored and a new trace started, as the W3C spec says)."""
    if traceparent is None:
        return None
    text = traceparent.decode("ascii", "replace") if isinstance(traceparent, bytes) else traceparent
    match = _TRACEPARENT.match(text.strip().lower())
    if not match or match[1] == _ZERO_TRACE or match[2] == _ZERO_SPAN:
        return None
    return TraceContext(match[1], match[2], bool(int(match[3], 16) & 1))


def of_trace(trace_id: str, seed: str) -> TraceContext | None:
    """A context in the trace `trace_id` (32 hex) for the span handling `seed`."""
    if len(trace_id) != 32 or trace_id == _ZERO_TRACE:
        return None
    return TraceContext(trace_id, derived_span_id(trace_id, seed))
