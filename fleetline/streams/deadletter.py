"""Dead-lettering: a message no processor could handle is kept whole, with why and where from."""

from __future__ import annotations

from dataclasses import dataclass

from confluent_kafka import Message

from fleetline.identity.writers import writer_header
from fleetline.streams.records import Record

H_REASON = "fleetline.dlq.reason"
H_ERROR = "fleetline.dlq.error"
H_APP = "fleetline.dlq.application"
H_TOPIC = "fleetline.dlq.topic"
H_PARTITION = "fleetline.dlq.partition"
H_OFFSET = "fleetline.dlq.offset"
# Who wrote the original, as its gate established it (a WriterRefused) or else as its own
# header claims it: the dead letter is written by the loop, so its own writer is not that.
H_WRITER = "fleetline.dlq.writer"


@dataclass(frozen=True)
class DeadLetter:
    """One dead-lettered message as read back from the dead-letter topic."""

    key: bytes | None
    value: bytes | None
    reason: str
    error: str
    application: str
    topic: str
    partition: int
    offset: int
    writer: str = ""

    @property
    def source_id(self) -> tuple[str, int, int]:
        """Where the message came from; the same message dead-lettered twice has one id."""
        return (self.topic, self.partition, self.offset)


def dead_letter_headers(
    msg: Record, application: str, error: Exception
) -> list[tuple[str, str | bytes | None]]:
    established = getattr(error, "writer", None)
    headers = getattr(msg, "headers", None)
    writer = established or writer_header(headers() if headers is not None else None) or ""
    return [
        (H_WRITER, writer.encode()),
        (H_REASON, str(error).encode()),
        (H_ERROR, type(error).__name__.encode()),
        (H_APP, application.encode()),
        (H_TOPIC, (msg.topic() or "").encode()),
        (H_PARTITION, str(msg.partition()).encode()),
        (H_OFFSET, str(msg.offset()).encode()),
    ]


def read_dead_letter(msg: Message) -> DeadLetter:
    raw = msg.headers() or []
    pairs = raw.items() if isinstance(raw, dict) else raw
    headers = {
        key: value.decode(errors="replace") if isinstance(value, bytes) else (value or "")
        for key, value in pairs
    }
    return DeadLetter(
        key=msg.key(),
        value=msg.value(),
        reason=headers.get(H_REASON, ""),
        error=headers.get(H_ERROR, ""),
        application=headers.get(H_APP, ""),
        topic=headers.get(H_TOPIC, ""),
        partition=int(headers.get(H_PARTITION, "-1")),
        offset=int(headers.get(H_OFFSET, "-1")),
        writer=headers.get(H_WRITER, ""),
    )
