"""Queries for a chdb store that another process owns.

chdb admits one process per data path. The owning process (the slice, the sink) serves read-only
queries on loopback and leaves a discovery file in the data folder; `run_query` goes through it
when it is there and opens the store itself when nobody owns it. A ClickHouse server URL is
queried directly by everyone.
"""

from __future__ import annotations

import json
import os
import threading
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from clickhouse_connect.driver.client import Client

from fleetline.errors import FleetlineError, QueryError, StorageError
from fleetline.storage.clickhouse import CLICKHOUSE_ERRORS, connect

DISCOVERY_FILE = "fleetline-query-service.json"
READ_ONLY = {"readonly": 1}


@dataclass(frozen=True)
class QueryResult:
    columns: list[str]
    rows: list[list[Any]]


# Rewrites `$samples` macros into the tiers a query's range needs (storage/tiers.py).
Expand = Callable[[Client, str], str]


def query_client(client: Client, sql: str, expand: Expand | None = None) -> QueryResult:
    """Run one read-only query on a client; ClickHouse's complaint becomes a QueryError."""
    if expand is not None and "$samples" in sql:
        sql = expand(client, sql)
    try:
        result = client.query(sql, settings=READ_ONLY)
    except CLICKHOUSE_ERRORS as exc:
        raise QueryError(str(exc).strip().splitlines()[0]) from None
    return QueryResult(list(result.column_names), [list(row) for row in result.result_rows])


def _chdb_path(url: str) -> Path | None:
    parts = urlsplit(url)
    return Path(parts.path) if parts.scheme == "chdb" else None


class QueryService:
    """Serves POST /query (body: SQL) on loopback for the process that owns a chdb store."""

    def __init__(
        self,
        client: Client,
        url: str,
        host: str = "127.0.0.1",
        port: int = 0,
        expand: Expand | None = None,
    ) -> None:
        self.client = client
        self.discovery = (_chdb_path(url) or Path(".")) / DISCOVERY_FILE
        service = self
        lock = threading.Lock()  # one chdb connection: queries take turns

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                if self.path != "/query":
                    self._reply(404, {"error": f"no route {self.path}; POST /query"})
                    return
                sql = self.rfile.read(int(self.headers.get("Content-Length", 0))).decode()
                try:
                    with lock:
                        result = query_client(service.client, sql, expand)
                except FleetlineError as exc:
                    self._reply(400, {"error": str(exc)})
                    return
                self._reply(200, {"columns": result.columns, "rows": result.rows})

            def _reply(self, status: int, body: dict[str, Any]) -> None:
                data = json.dumps(body, default=str).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer((host, port), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def address(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host!s}:{port}"

    def start(self) -> QueryService:
        self.thread.start()
        self.discovery.write_text(json.dumps({"url": self.address, "pid": os.getpid()}))
        return self

    def stop(self) -> None:
        self.discovery.unlink(missing_ok=True)
        self.server.shutdown()
        self.server.server_close()


def _owner(url: str) -> str | None:
    path = _chdb_path(url)
    if path is None:
        return None
    try:
        info = json.loads((path / DISCOVERY_FILE).read_text())
        os.kill(int(info["pid"]), 0)
    except (FileNotFoundError, ValueError, KeyError, ProcessLookupError):
        return None
    if int(info["pid"]) == os.getpid():
        return None  # we own it: query directly
    return str(info["url"])


def run_query(
    url: str, sql: str, timeout_s: float = 60.0, expand: Expand | None = None
) -> QueryResult:
    """Run a read-only query on the store at `url`, through its owner if another process has it."""
    owner = _owner(url)
    if owner is None:
        return query_client(connect(url), sql, expand)
    request = urllib.request.Request(f"{owner}/query", data=sql.encode(), method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            body = json.loads(response.read())
    except urllib.error.HTTPError as exc:
        raise QueryError(json.loads(exc.read()).get("error", str(exc))) from None
    except (urllib.error.URLError, OSError) as exc:
        raise StorageError(f"the process owning {url} did not answer at {owner}: {exc}") from None
    return QueryResult(body["columns"], body["rows"])
