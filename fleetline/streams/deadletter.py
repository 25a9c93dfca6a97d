"""Dead-lettering: a message no processor could handle is kept whole, with why and where from."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from confluent_kafka import Message, Producer

H_REASON = "fleetline.dlq.reason"
H_ERROR = "fleetline.dlq.error"
H_APP = "fleetline.dlq.application"
H_TOPIC = "fleetline.dlq.topic"
H_PARTITION = "fleetline.dlq.partition"
H_OFFSET = "fleetline.dlq.offset"


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

    @property
    def source_id(self) -> tuple[str, int, int]:
        """Where the message came from; the same message dead-lettered twice has one id."""
        return (self.topic, self.partition, self.offset)


def dead_letter_headers(
    msg: Message, application: str, error: Exception
) -> list[tuple[str, bytes]]:
    return [
        (H_REASON, str(error).encode()),
        (H_ERROR, type(error).__name__.encode()),
        (H_APP, application.encode()),
        (H_TOPIC, (msg.topic() or "").encode()),
        (H_PARTITION, str(msg.partition()).encode()),
        (H_OFFSET, str(msg.offset()).encode()),
    ]


def send_dead_letter(producer: Producer, topic: str, application: str, msg: Message,
                     error: Exception) -> None:
    """Log and produce one dead letter: the message whole, with why and where from. The caller
    flushes before it commits past the message."""
    logging.getLogger(f"fleetline.{application}").warning(
        "%s: dead-lettering %s[%d]@%d: %s", application, msg.topic(), msg.partition(),
        msg.offset(), error)
    producer.produce(topic, key=msg.key(), value=msg.value(),
                     headers=dead_letter_headers(msg, application, error))


def read_dead_letter(msg: Message) -> DeadLetter:
    headers = {key: (value or b"").decode() for key, value in (msg.headers() or [])}
    return DeadLetter(
        key=msg.key(),
        value=msg.value(),
        reason=headers.get(H_REASON, ""),
        error=headers.get(H_ERROR, ""),
        application=headers.get(H_APP, ""),
        topic=headers.get(H_TOPIC, ""),
        partition=int(headers.get(H_PARTITION, "-1")),
        offset=int(headers.get(H_OFFSET, "-1")),
    )
