"""Structured logs: JSON lines with the trace id, shipped through a Kafka topic into ClickHouse.

Every long-running process (`serve`, the node agents, the cluster agent) writes its log lines
as JSON to stderr (`--log-format json`, or `FLEETLINE_LOG_FORMAT=json`) and ships them to the
`<prefix>.logs` topic as `LogRecord`s, which `serve` sinks into ClickHouse's `logs` table:
searchable by SQL and in the dashboard, joined to everything else by `trace_id`. The trace id
of the work in hand comes from a context variable the API and the processors set (`traced`).
"""

from __future__ import annotations

import contextvars
import json
import logging
import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

_trace: contextvars.ContextVar[str] = contextvars.ContextVar("fleetline_trace_id", default="")
# Attributes every LogRecord has; anything else a call passed in `extra` is a field of its own.
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime"}


@contextmanager
def traced(trace_id: str | None) -> Iterator[None]:
    """Log lines written inside carry `trace_id`."""
    token = _trace.set(trace_id or "")
    try:
        yield
    finally:
        _trace.reset(token)


def _fields(record: logging.LogRecord) -> dict[str, str]:
    fields = {k: str(v) for k, v in vars(record).items() if k not in _STANDARD and k != "trace_id"}
    fields["thread"] = record.threadName or ""
    if record.exc_info and record.exc_info[0] is not None:
        fields["exception"] = logging.Formatter().formatException(record.exc_info)
    return fields


def _trace_of(record: logging.LogRecord) -> str:
    return str(getattr(record, "trace_id", "") or _trace.get())


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts (epoch ms), level, logger, process, message, trace_id and
    the line's other fields."""

    def __init__(self, process: str) -> None:
        super().__init__()
        self.process = process

    def format(self, record: logging.LogRecord) -> str:
        return json.dumps(
            {
                "ts": int(record.created * 1000),
                "level": record.levelname,
                "logger": record.name,
                "process": self.process,
                "message": record.getMessage(),
                "trace_id": _trace_of(record),
                **_fields(record),
            },
            default=str,
        )


class KafkaLogHandler(logging.Handler):
    """Ships log records to the logs topic. Never blocks the caller: when librdkafka's queue
    is full a line is dropped and counted (`dropped`)."""

    def __init__(
        self,
        producer: Any,
        encode: Callable[[dict[str, Any]], bytes],
        topic: str,
        process: str,
        cluster_id: str = "",
        level: int = logging.INFO,
    ) -> None:
        """`producer` (a confluent-kafka Producer) sends `encode(LogRecord)` to `topic`; its
        own librdkafka lines must go to the `fleetline.logship` logger, which is not shipped."""
        super().__init__(level)
        self.producer = producer
        self.encode = encode
        self.topic = topic
        self.process = process
        self.cluster_id = cluster_id
        self.host = socket.gethostname()
        self.dropped = 0
        self._inside = threading.local()

    def emit(self, record: logging.LogRecord) -> None:
        if record.name.startswith("fleetline.logship") or getattr(self._inside, "on", False):
            return
        self._inside.on = True
        try:
            value = self.encode(
                {
                    "ts": int(record.created * 1000),
                    "level": record.levelname,
                    "logger": record.name,
                    "process": self.process,
                    "host": self.host,
                    "cluster_id": self.cluster_id,
                    "message": record.getMessage(),
                    "trace_id": _trace_of(record),
                    "fields": _fields(record),
                },
            )
            self.producer.produce(self.topic, key=self.process.encode(), value=value)
            self.producer.poll(0)
        except BufferError:
            self.dropped += 1
        # A log line that cannot be shipped must not break the code that logged it.
        except Exception:
            self.handleError(record)
        finally:
            self._inside.on = False

    def close(self) -> None:
        self.producer.flush(5)
        super().close()


def configure(process: str, json_lines: bool) -> None:
    """Format the root logger's handlers as JSON lines (or keep the text format)."""
    if not json_lines:
        return
    for handler in logging.getLogger().handlers:
        handler.setFormatter(JsonFormatter(process))


def ship(handler: KafkaLogHandler) -> KafkaLogHandler:
    """Ship this process's log lines (INFO and above) through `handler`; close it with
    `unship` when the process ends."""
    root = logging.getLogger()
    root.addHandler(handler)
    # The handler ships INFO; the root level may be higher (WARNING without --verbose).
    if root.level > logging.INFO:
        for other in root.handlers:
            if other is not handler and other.level == logging.NOTSET:
                other.setLevel(root.level)
        root.setLevel(logging.INFO)
    return handler


def unship(handler: KafkaLogHandler) -> None:
    logging.getLogger().removeHandler(handler)
    handler.close()
