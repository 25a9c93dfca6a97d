"""Moments as operators write them: `-<n>s|m|h|d` before now, epoch milliseconds, or an
ISO 8601 time (UTC when it names no zone). Pure: `now_ms` comes from the caller."""

from __future__ import annotations

import re
from datetime import UTC, datetime

from fleetline.errors import ConfigError

_RELATIVE = re.compile(r"^-(?P<n>\d+)(?P<unit>[smhd])$")
_UNITS = {"s": 1000, "m": 60_000, "h": 3600 * 1000, "d": 24 * 3600 * 1000}


def parse_moment(text: str, now_ms: int) -> int:
    """-<n>s|m|h|d before now, epoch milliseconds, or an ISO 8601 time (UTC if no zone)."""
    relative = _RELATIVE.match(text)
    if relative:
        return now_ms - int(relative["n"]) * _UNITS[relative["unit"]]
    if text.isdigit():
        return int(text)
    try:
        moment = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise ConfigError(
            f"{text!r} is neither epoch milliseconds nor an ISO 8601 time (nor -<n>s|m|h|d)"
        ) from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return int(moment.timestamp() * 1000)
