"""A cluster agent's peers: its probe server (it answers a peer's PING with PONG) and its prober
(it asks every peer's agent over TCP each heartbeat, and measures the round trip). What it sees
of each peer rides on its heartbeat, for the health fold to tell a partition from a loss. A
chaos file (fault injection) names peers whose link counts as cut both ways."""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Peers:
    cluster_id: str
    advertise_host: str
    heartbeat_s: float = 1.0
    probe_timeout_s: float = 0.3
    chaos_file: Path | None = None  # peers whose link is cut, one per line
    addresses: dict[str, str] = field(default_factory=dict)  # cluster -> probe address
    reach: dict[str, tuple[bool, float | None]] = field(default_factory=dict)
    probe_address: str | None = None

    def blocked(self) -> set[str]:
        if self.chaos_file is None:
            return set()
        try:
            return {
                line.strip() for line in self.chaos_file.read_text().splitlines() if line.strip()
            }
        except OSError:
            return set()

    def serve(self, stop: threading.Event) -> socket.socket:
        server = socket.socket()
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind((self.advertise_host, 0))
        server.listen(16)
        server.settimeout(0.2)
        host, port = server.getsockname()[:2]
        self.probe_address = f"{host}:{port}"

        def serve() -> None:
            while not stop.is_set():
                try:
                    conn, _ = server.accept()
                except (TimeoutError, OSError):
                    continue
                with conn:
                    conn.settimeout(self.probe_timeout_s)
                    try:
                        asker = conn.recv(256).decode().removeprefix("PING ").strip()
                        if asker not in self.blocked():
                            conn.sendall(f"PONG {self.cluster_id}\n".encode())
                    except OSError:
                        pass

        threading.Thread(target=serve, daemon=True).start()
        return server

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            blocked = self.blocked()
            for cluster_id, address in sorted(self.addresses.items()):
                if cluster_id in blocked:
                    self.reach[cluster_id] = (False, None)
                    continue
                self.reach[cluster_id] = self.probe(address)
            stop.wait(self.heartbeat_s)

    def probe(self, address: str) -> tuple[bool, float | None]:
        host, _, port = address.rpartition(":")
        began = time.perf_counter()
        try:
            with socket.create_connection((host, int(port)), timeout=self.probe_timeout_s) as conn:
                conn.settimeout(self.probe_timeout_s)
                conn.sendall(f"PING {self.cluster_id}\n".encode())
                answer = conn.recv(256)
        except OSError:
            return False, None
        if not answer.startswith(b"PONG"):
            return False, None
        return True, round((time.perf_counter() - began) * 1000, 3)
