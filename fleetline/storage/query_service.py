"""Queries for a chdb store that another process owns.

chdb admits one process per data path. The owning process (the slice, the sink) serves read-only
queries on loopback and leaves a discovery file in the data folder; `run_query` goes through it
when it is there and opens the store itself when nobody owns it. A ClickHouse server URL is
queried directly by everyone.
"""

from __future__ import annotations

import dataclasses
import hmac
import json
import logging
import os
import re
import secrets
import threading
import urllib.error
import urllib.request
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit

from clickhouse_connect.driver.client import Client

from fleetline.config import QueryLimits
from fleetline.errors import FleetlineError, QueryError, StorageError
from fleetline.storage.clickhouse import CLICKHOUSE_ERRORS, connect
from fleetline.storage.sql_guard import refusal
from fleetline.tls import pinned_client, pinned_identity

DISCOVERY_FILE = "fleetline-query-service.json"
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class QueryResult:
    columns: list[str]
    rows: list[list[Any]]


class Expand(Protocol):
    """Rewrites `$samples` (and the other macros) into the tiers a query's range needs
    (storage/tiering/macros.py); `hot_only` puts the hot table in place of every tier. SQL without a
    macro comes back unchanged."""

    def __call__(self, client: Client, sql: str, *, hot_only: bool = False) -> str: ...


# ClickHouse's word for an object that was not there when s3() read it.
_OBJECT_GONE = re.compile(r"HTTP response code: 404|NoSuchKey|does not exist", re.IGNORECASE)


class _ObjectGone(QueryError):
    """s3() found no object where the query's expansion said one was."""


# ClickHouse's codes for what an analyst query may not do, and what to tell its author.
_REFUSALS = {
    "TIMEOUT_EXCEEDED": "it ran past {max_execution_s:g} s (FLEETLINE_SQL_MAX_SECONDS)",
    "MEMORY_LIMIT_EXCEEDED": "it needed more than {max_memory_bytes} bytes of memory "
    "(FLEETLINE_SQL_MAX_MEMORY_BYTES)",
    "TOO_MANY_ROWS_OR_BYTES": "its result is over {max_result_rows} rows or {max_result_bytes} "
    "bytes (FLEETLINE_SQL_MAX_RESULT_ROWS, FLEETLINE_SQL_MAX_RESULT_BYTES; aggregate or LIMIT)",
    "READONLY": "queries are read-only: a SELECT over the store's tables, without a SETTINGS "
    "clause or a table function that reaches outside the store (file, url, s3)",
}


def _run(client: Client, sql: str, settings: dict[str, Any], limits: QueryLimits) -> QueryResult:
    try:
        result = client.query(sql, settings=settings)
    except CLICKHOUSE_ERRORS as exc:
        message = str(exc)
        first = message.strip().splitlines()[0]
        if "S3_ERROR" in message and _OBJECT_GONE.search(message):
            raise _ObjectGone(first) from None
        for code, refusal in _REFUSALS.items():
            if f"({code})" in message:
                reason = refusal.format(**dataclasses.asdict(limits))
                raise QueryError(f"query refused: {reason}. ClickHouse: {first}") from None
        raise QueryError(first) from None
    return QueryResult(list(result.column_names), [list(row) for row in result.result_rows])


_NOT_A_TREE = re.compile(r"AST node of type '(\w+)' does not support JSON serialization")


def _guard(client: Client, sql: str, database: str) -> None:
    """QueryError unless the query names only what analyst SQL may (storage/sql_guard.py),
    judged on ClickHouse's own parse of it; nothing of the query runs here."""
    try:
        result = client.query("SELECT parseQueryToJSON({sql:String})", parameters={"sql": sql})
    except CLICKHOUSE_ERRORS as exc:
        first = str(exc).strip().splitlines()[0]
        unserialisable = _NOT_A_TREE.search(str(exc))
        if unserialisable:  # only statements other than SELECT lack a JSON form
            raise QueryError(
                f"query refused: only SELECT queries are answered (this is {unserialisable[1]})"
            ) from None
        if "parseQueryToJSON" in str(exc) and "UNKNOWN_FUNCTION" in str(exc):
            raise QueryError(
                "query refused: this ClickHouse cannot parse a query for the analyst allow-list "
                "(parseQueryToJSON came in ClickHouse 25); no query runs unchecked"
            ) from None
        raise QueryError(first) from None
    why = refusal(json.loads(result.result_rows[0][0]), database)
    if why is not None:
        raise QueryError(f"query refused: {why}")


def query_client(
    client: Client,
    sql: str,
    expand: Expand | None = None,
    limits: QueryLimits | None = None,
    *,
    database: str,
) -> QueryResult:
    """Run one analyst query on a client, read-only and within `limits`; ClickHouse's complaint
    becomes a QueryError.

    First the query is held to the analyst allow-list (the store's tables in `database`, pure
    functions; storage/sql_guard.py), the macros standing for the hot table. Then it is run
    with `readonly=1`: no writes, no SETTINGS clause (so no lifting the limits)
    and no table functions that reach outside the store (s3, url, file). The tiers, though, are
    read through s3(), which `readonly=1` refuses; so a query with macros is first planned under
    `readonly=1` with the hot table standing for every tier (which refuses all of the above in
    the caller's own SQL), then run as expanded under `readonly=2`, which still refuses writes.

    An expanded query names the objects the manifests held when it was expanded; a tiering pass
    may move one (warm hours compacted into a cold archive) before ClickHouse reads it. Such a
    query is expanded again from the manifests as they are now and run once more."""
    limits = limits or QueryLimits()
    bounded = limits.clickhouse_settings()
    checked = sql if expand is None else expand(client, sql, hot_only=True)
    _guard(client, checked, database)
    if expand is None or checked == sql:
        return _run(client, sql, {**bounded, "readonly": 1}, limits)
    try:
        _run(client, f"EXPLAIN PLAN {checked}", {"readonly": 1}, limits)
    except QueryError as exc:
        if "Only SELECT is supported for EXPLAIN" not in str(exc):
            raise
        raise QueryError(f"query refused: {_REFUSALS['READONLY']}. ClickHouse: {exc}") from None
    try:
        return _run(client, expand(client, sql), {**bounded, "readonly": 2}, limits)
    except _ObjectGone:
        return _run(client, expand(client, sql), {**bounded, "readonly": 2}, limits)


def _chdb_path(url: str) -> Path | None:
    parts = urlsplit(url)
    return Path(parts.path) if parts.scheme == "chdb" else None


class _QuietServer(ThreadingHTTPServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        # A caller that is not a TLS client, or that went away: its connection is closed,
        # and nothing about it is worth a traceback on the owner's terminal.
        log.debug("query service: a connection from %s failed", client_address, exc_info=True)


class QueryService:
    """Serves POST /query (body: SQL) for the process that owns a chdb store, on the host's
    advertised address (loopback unless FLEETLINE_ADVERTISE_HOST says otherwise).

    A caller must send the token the discovery file holds (readable by the store's owner
    only, as the data folder is): whoever may open the store may query it through its owner,
    nobody else who reaches the address."""

    def __init__(
        self,
        client: Client,
        url: str,
        host: str = "127.0.0.1",
        port: int = 0,
        expand: Expand | None = None,
        limits: QueryLimits | None = None,
        *,
        database: str,
    ) -> None:
        self.client = client
        self.discovery = (_chdb_path(url) or Path(".")) / DISCOVERY_FILE
        self.token = secrets.token_urlsafe(32)
        service = self
        lock = threading.Lock()  # one chdb connection: queries take turns

        class Handler(BaseHTTPRequestHandler):
            timeout = 30  # a caller that stalls, in the handshake or after, is let go

            def setup(self) -> None:
                # The handshake happens here, in the request's thread, not in the accepting
                # one, where a caller that never speaks would hold up every other.
                self.request.settimeout(self.timeout)
                self.request.do_handshake()
                super().setup()

            def do_POST(self) -> None:
                if self.path != "/query":
                    self._reply(404, {"error": f"no route {self.path}; POST /query"})
                    return
                sent = self.headers.get("Authorization", "")
                if not hmac.compare_digest(sent.encode(), f"Bearer {service.token}".encode()):
                    self._reply(
                        401,
                        {
                            "error": "the store's query token is needed (its owner's "
                            f"{DISCOVERY_FILE})"
                        },
                    )
                    return
                sql = self.rfile.read(int(self.headers.get("Content-Length", 0))).decode()
                try:
                    with lock:
                        result = query_client(
                            service.client, sql, expand, limits, database=database
                        )
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

        self.server = _QuietServer((host, port), Handler)
        # TLS always: the certificate is made for this start and pinned by the callers, who
        # read it from the owner-only discovery file with the token.
        tls, self.certificate = pinned_identity(host)
        self.server.socket = tls.wrap_socket(
            self.server.socket, server_side=True, do_handshake_on_connect=False
        )
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def address(self) -> str:
        host, port = self.server.server_address[:2]
        return f"https://{host!s}:{port}"

    def start(self) -> QueryService:
        self.thread.start()
        # Created owner-only before the token is written into it.
        descriptor = os.open(self.discovery, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(descriptor, "w") as handle:
            json.dump(
                {
                    "url": self.address,
                    "pid": os.getpid(),
                    "token": self.token,
                    "certificate": self.certificate,
                },
                handle,
            )
        return self

    def stop(self) -> None:
        self.discovery.unlink(missing_ok=True)
        self.server.shutdown()
        self.server.server_close()


def owned_elsewhere(url: str) -> bool:
    """Whether another process holds the store at `url` (queries go through it)."""
    return _owner(url) is not None


def _owner(url: str) -> tuple[str, str, str | None] | None:
    """The address, token and certificate of the process serving the store at `url`, if
    another has it."""
    path = _chdb_path(url)
    if path is None:
        return None
    try:
        info = json.loads((path / DISCOVERY_FILE).read_text())
        os.kill(int(info["pid"]), 0)
    except (FileNotFoundError, ValueError, KeyError, ProcessLookupError):
        return None
    except PermissionError:
        raise StorageError(
            f"{path / DISCOVERY_FILE} is not readable by this user: the store at {url} belongs "
            "to another (run as its owner)"
        ) from None
    if int(info["pid"]) == os.getpid():
        return None  # we own it: query directly
    return str(info["url"]), str(info.get("token", "")), info.get("certificate")


def run_query(
    url: str,
    sql: str,
    timeout_s: float = 60.0,
    expand: Expand | None = None,
    limits: QueryLimits | None = None,
    *,
    database: str,
) -> QueryResult:
    """Run a read-only query on the store at `url`, through its owner if another process has it
    (the owner's limits apply there, this process's here)."""
    owner = _owner(url)
    if owner is None:
        return query_client(connect(url), sql, expand, limits, database=database)
    address, token, certificate = owner
    request = urllib.request.Request(
        f"{address}/query",
        data=sql.encode(),
        method="POST",
        headers={"Authorization": f"Bearer {token}"},
    )
    try:
        with urllib.request.urlopen(
            request, timeout=timeout_s, context=pinned_client(certificate) if certificate else None
        ) as response:
            body = json.loads(response.read())
    except urllib.error.HTTPError as exc:
        raise QueryError(json.loads(exc.read()).get("error", str(exc))) from None
    except (urllib.error.URLError, OSError) as exc:
        raise StorageError(f"the process owning {url} did not answer at {address}: {exc}") from None
    return QueryResult(body["columns"], body["rows"])
