"""Whether a service's address accepts a connection: what the commands' fail-fast checks and
the local services' start-up both ask before anything slower."""

from __future__ import annotations

import socket


def refusal(host: str, port: int, timeout_s: float) -> str | None:
    """None when `host:port` accepts a TCP connection within `timeout_s`, else why not."""
    try:
        with socket.create_connection((host.strip("[]"), port), timeout=timeout_s):
            return None
    except OSError as exc:
        return str(exc)
