"""`fleetline router`: the traffic entry layer.

    POST /v1/services/{tenant}/{service}/infer   (header X-Fleetline-Region: the client's)
    GET  /v1/routes[?region=R]                   every service's ready replicas and weights
    GET  /healthz

It follows the service registry (`<prefix>.services.replicas`, read from its start: the
compacted latest record of each replica) and the clusters topic (regions and RTTs) on a thread
of its own, and forwards each request to the replica `routing.choose` picks, over a pool of
kept-alive connections. A try that fails (no answer, a 5xx: a replica killed or draining) goes
to the next-best replica, at most `retries` more, while the retry budget (`retry_budget_ratio`
per request, `retry_budget_min` at least) lasts; the reply says which replica answered and how
many tries it took. Every `report_ms` it appends each service's load over the window (requests
by client region, latency percentiles, slot utilisation, queues) to the scheduler's log as a
SERVICE_LOAD request, which the autoscaler folds.

With an admission check (`admit`: the API's tokens and roles, built where the command is) a
request without a valid bearer token gets 401 and one for a tenant its token may not reach
403, before any replica is tried. With TLS settings (tls.py) it listens for HTTPS and calls
the replicas over mutual TLS, showing its own certificate: the replicas serve only its
identity.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from aiohttp import ClientError, ClientSession, ClientTimeout, TCPConnector, web
from confluent_kafka import OFFSET_BEGINNING, KafkaError, TopicPartition

from fleetline.agents.router.listen import listen
from fleetline.agents.router.routing import Registry, RoutingPolicy, choose, load_report, weights
from fleetline.config import Settings
from fleetline.errors import AuthenticationError, PermissionDenied
from fleetline.identity.writers import Writer, WriterKind
from fleetline.processors.scheduling.client import request_output
from fleetline.processors.scheduling.codec import new_request
from fleetline.streams import kafka as kafka_clients
from fleetline.streams.loop import produce
from fleetline.streams.serde import default_codec
from fleetline.streams.topics import Topics

log = logging.getLogger(__name__)

# Whether a caller may ask a tenant's services for inference: (the Authorization header, the
# tenant) -> None, or AuthenticationError / PermissionDenied saying why not.
Admit = Callable[[str | None, str], None]


def _now_ms() -> int:
    return int(time.time() * 1000)


@dataclass
class Window:
    """One service's traffic since the last report."""

    began: float
    latencies: list[float] = field(default_factory=list)
    by_region: dict[str, int] = field(default_factory=dict)
    errors: int = 0
    busy_ms: float = 0.0  # slot-milliseconds of requests this router had at its replicas


@dataclass
class Counters:
    requests: int = 0
    answered: int = 0
    failed: int = 0  # no replica answered within the tries and the budget
    retries: int = 0
    budget_exhausted: int = 0
    no_replica: int = 0
    unauthenticated: int = 0  # no or an unknown token: 401
    forbidden: int = 0  # a token that may not reach the tenant's services: 403

    def as_data(self) -> dict[str, int]:
        return dict(self.__dict__)


class Router:
    def __init__(
        self,
        settings: Settings,
        topics: Topics,
        policy: RoutingPolicy | None = None,
        name: str | None = None,
        report: bool = True,
        admit: Admit | None = None,
        writer_name: str = "router",
    ) -> None:
        self.settings = settings
        # Who its load reports are from: the router identity enrolled for this deployment's
        # routers (`fleetline enroll router NAME`), shared by its processes.
        self.writer_name = writer_name
        self.admit = admit
        self.topics = topics
        self.policy = policy or RoutingPolicy()
        self.name = name or f"router-{uuid.uuid4().hex[:8]}"
        self.report = report
        self.registry = Registry()
        self.observed_ms: dict[str, float] = {}
        self.inflight: dict[str, int] = {}
        self.avoid: dict[str, int] = {}
        self.windows: dict[str, Window] = {}
        self.counters = Counters()
        self.budget = float(self.policy.retry_budget_min)
        self.synced = threading.Event()  # the registry has been read to its end once
        self.codec = default_codec()
        self.address: str | None = None

    # -- the registry -------------------------------------------------------------------------

    def follow(self, stop: threading.Event) -> None:
        consumer = kafka_clients.consumer(self.settings.kafka, f"{self.name}.registry")
        parts = [TopicPartition(t, 0) for t in (self.topics.replicas, self.topics.clusters)]
        ends = {tp.topic: consumer.get_watermark_offsets(tp, timeout=30)[1] for tp in parts}
        consumer.assign([TopicPartition(tp.topic, 0, OFFSET_BEGINNING) for tp in parts])
        try:
            while not stop.is_set():
                for msg in consumer.consume(500, 0.05):
                    error = msg.error()
                    if error is not None:
                        if error.code() != KafkaError._PARTITION_EOF:
                            log.warning("%s: %s", self.name, error.str())
                        continue
                    decoded = self.codec.decode(msg.value())
                    self.registry.fold(decoded.schema.full_name, decoded.record)
                if not self.synced.is_set():
                    positions = consumer.position(parts)
                    if all(p.offset >= ends[p.topic] or ends[p.topic] == 0 for p in positions):
                        self.synced.set()
        finally:
            consumer.close()

    # -- requests -----------------------------------------------------------------------------

    def _refused(self, request: web.Request, tenant: str) -> web.Response | None:
        if self.admit is None:
            return None
        try:
            self.admit(request.headers.get("Authorization"), tenant)
        except AuthenticationError as exc:
            self.counters.unauthenticated += 1
            return web.json_response(
                {"error": str(exc)}, status=401, headers={"WWW-Authenticate": "Bearer"}
            )
        except PermissionDenied as exc:
            self.counters.forbidden += 1
            return web.json_response({"error": str(exc)}, status=403)
        return None

    async def infer(self, request: web.Request) -> web.Response:
        tenant = request.match_info["tenant"]
        refused = self._refused(request, tenant)
        if refused is not None:
            return refused
        service = f"{tenant}/{request.match_info['service']}"
        region = request.headers.get("X-Fleetline-Region") or request.query.get("region")
        body = await request.read()
        began = time.perf_counter()
        self.counters.requests += 1
        self.budget = min(
            self.budget + self.policy.retry_budget_ratio,
            float(max(self.policy.retry_budget_min, 1) * 10),
        )
        window = self.windows.setdefault(service, Window(time.monotonic()))
        if region:
            window.by_region[region] = window.by_region.get(region, 0) + 1
        tried: list[str] = []
        last_error = "no ready replica"
        while len(tried) <= self.policy.retries:
            now = _now_ms()
            endpoint = choose(
                self.registry,
                service,
                region,
                now,
                self.policy,
                self.observed_ms,
                self.inflight,
                self.avoid,
                tried,
            )
            if endpoint is None:
                if not tried:
                    self.counters.no_replica += 1
                break
            if tried:
                if self.budget < 1:
                    self.counters.budget_exhausted += 1
                    last_error += "; the retry budget is spent"
                    break
                self.budget -= 1
                self.counters.retries += 1
            tried.append(endpoint.replica)
            assert endpoint.address is not None  # routable endpoints have one
            self.inflight[endpoint.replica] = self.inflight.get(endpoint.replica, 0) + 1
            sent = time.perf_counter()
            try:
                async with self.session.post(
                    f"{endpoint.address}/v1/infer",
                    data=body,
                    headers={"Content-Type": "application/json"},
                ) as answer:
                    payload = await answer.read()
                    status = answer.status
            except (ClientError, TimeoutError, OSError) as exc:
                status, payload = 0, str(exc).encode()
            finally:
                self.inflight[endpoint.replica] -= 1
                spent_ms = (time.perf_counter() - sent) * 1000
                window.busy_ms += spent_ms
            if status == 0 or status >= 500:
                last_error = f"{endpoint.replica}: " + (
                    f"status {status}" if status else payload.decode(errors="replace")[:200]
                )
                self.avoid[endpoint.replica] = _now_ms() + self.policy.failure_backoff_ms
                continue
            previous = self.observed_ms.get(endpoint.replica)
            self.observed_ms[endpoint.replica] = (
                spent_ms
                if previous is None
                else previous + self.policy.ewma * (spent_ms - previous)
            )
            self.counters.answered += 1
            window.latencies.append((time.perf_counter() - began) * 1000)
            return web.Response(
                body=payload,
                status=status,
                content_type="application/json",
                headers={
                    "X-Fleetline-Replica": endpoint.replica,
                    "X-Fleetline-Tries": str(len(tried)),
                },
            )
        self.counters.failed += 1
        window.errors += 1
        return web.json_response(
            {"error": last_error, "service": service, "tried": tried},
            status=503,
            headers={"X-Fleetline-Tries": str(len(tried))},
        )

    def routes(self, region: str | None) -> dict[str, Any]:
        now = _now_ms()
        return {
            "router": self.name,
            "policy": self.policy.as_data(),
            "counters": self.counters.as_data(),
            "services": {
                service: {
                    "replicas": [
                        {
                            "replica": e.replica,
                            "cluster_id": e.cluster_id,
                            "region": e.region,
                            "state": e.state if e.fresh(now, self.policy) else "SILENT",
                            "inflight": e.inflight,
                            "queue": e.queue,
                            "concurrency": e.concurrency,
                        }
                        for e in sorted(self.registry.endpoints.values(), key=lambda e: e.replica)
                        if e.service == service and e.state != "GONE"
                    ],
                    "weights": [
                        w.as_data()
                        for w in weights(
                            self.registry,
                            self.registry.routable(service, now, self.policy),
                            region,
                            self.policy,
                            self.observed_ms,
                            self.inflight,
                        )
                    ],
                }
                for service in self.registry.services()
            },
        }

    async def routes_handler(self, request: web.Request) -> web.Response:
        return web.json_response(self.routes(request.query.get("region")))

    async def healthz(self, request: web.Request) -> web.Response:
        synced = self.synced.is_set()
        return web.json_response(
            {"synced": synced, "router": self.name}, status=200 if synced else 503
        )

    # -- load reports -------------------------------------------------------------------------

    def reports(self) -> list[tuple[str, dict[str, Any]]]:
        """Each service's load since the last report (services with ready replicas or
        traffic), and a new window for each."""
        now_ms, now = _now_ms(), time.monotonic()
        out = []
        for service in sorted(set(self.windows) | set(self.registry.services())):
            ready = self.registry.routable(service, now_ms, self.policy)
            window = self.windows.get(service) or Window(now - self.policy.report_ms / 1000)
            if not ready and not window.latencies and not window.errors:
                continue
            self.windows[service] = Window(now)
            out.append(
                (
                    service,
                    load_report(
                        self.name,
                        max(1, int((now - window.began) * 1000)),
                        window.latencies,
                        window.by_region,
                        window.errors,
                        window.busy_ms,
                        sum(max(e.concurrency, 1) for e in ready),
                        sum(e.queue for e in ready),
                    ),
                )
            )
        return out

    async def _reporter(self, producer: Any) -> None:
        while True:
            await asyncio.sleep(self.policy.report_ms / 1000)
            for service, payload in self.reports():
                tenant = service.split("/", 1)[0]
                request = new_request(
                    "SERVICE_LOAD",
                    service,
                    tenant,
                    _now_ms(),
                    uuid.uuid4().hex,
                    actor=f"router/{self.name}",
                    spec_json=json.dumps(payload, sort_keys=True, separators=(",", ":")),
                )
                produce(producer, request_output(self.topics, request, self.codec))
            producer.poll(0)

    # -- the server ---------------------------------------------------------------------------

    async def serve(
        self, host: str, port: int, stop: threading.Event, reuse_port: bool = False
    ) -> None:
        tls = self.settings.tls
        self.session = ClientSession(
            connector=TCPConnector(
                limit=0, keepalive_timeout=30, ssl=tls.client_context() if tls else True
            ),
            timeout=ClientTimeout(total=self.policy.timeout_ms / 1000),
        )
        app = web.Application()
        app.router.add_post("/v1/services/{tenant}/{service}/infer", self.infer)
        app.router.add_get("/v1/routes", self.routes_handler)
        app.router.add_get("/healthz", self.healthz)
        runner, self.address = await listen(
            app,
            host,
            port,
            tls.server_context(verify_clients=False) if tls else None,
            reuse_port=reuse_port,
        )
        producer = (
            kafka_clients.producer(
                self.settings.kafka.writing_as(Writer(WriterKind.ROUTER, self.writer_name)),
                {"linger.ms": 5},
            )
            if self.report
            else None
        )
        reporter = asyncio.create_task(self._reporter(producer)) if producer else None
        try:
            while not stop.is_set():
                await asyncio.sleep(0.1)
        finally:
            if reporter is not None:
                reporter.cancel()
            await runner.cleanup()
            await self.session.close()
            if producer is not None:
                producer.flush(5)

    def run(self, host: str, port: int, stop: threading.Event, reuse_port: bool = False) -> None:
        """Follow the registry and serve until `stop` is set (`reuse_port`: one of several
        router processes on one port)."""
        follower = threading.Thread(target=self.follow, args=(stop,), daemon=True)
        follower.start()
        try:
            asyncio.run(self.serve(host, port, stop, reuse_port))
        finally:
            stop.set()
            follower.join(5)


def start_router(
    settings: Settings,
    topics: Topics,
    policy: RoutingPolicy | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
    report: bool = True,
    admit: Admit | None = None,
) -> tuple[Router, threading.Event, threading.Thread]:
    """A router on a thread of its own, once it listens and has read the registry."""
    router = Router(settings, topics, policy, report=report, admit=admit)
    stop = threading.Event()
    thread = threading.Thread(target=router.run, args=(host, port, stop), daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while (router.address is None or not router.synced.is_set()) and time.monotonic() < deadline:
        if not thread.is_alive():
            raise RuntimeError("the router stopped while starting")
        time.sleep(0.05)
    return router, stop, thread


def read_registry(settings: Settings, topics: Topics) -> Registry:
    """The registry as it stands: the replicas topic and the clusters topic read to their end."""
    registry = Registry()
    codec = default_codec()
    for topic in (topics.clusters, topics.replicas):
        for msg in kafka_clients.read_to_end(
            settings.kafka, topic, [0], f"fleetline-read-{uuid.uuid4().hex[:12]}", 30
        ):
            decoded = codec.decode(msg.value())
            registry.fold(decoded.schema.full_name, decoded.record)
    return registry


def load_policy(data: Mapping[str, Any] | None) -> RoutingPolicy:
    return RoutingPolicy.from_data(data or {})
