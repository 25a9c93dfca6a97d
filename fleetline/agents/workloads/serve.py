"""`fleetline workload serve`: one inference replica under the workload contract.

An HTTP model server on loopback. It loads its model from object storage: the newest complete
checkpoint under the model's prefix in its cluster's store (`storage/checkpoints.py`, sealed
under the tenant's key when one is configured); when there is none yet, it builds the model
from the model's name (the same two-layer network `workload train` learns, its weights drawn
from a seed derived from the name) and saves it there first, so every later replica in the
cluster loads the same bytes. It is Ready only once the model is loaded and it has answered a
probe of its own: then it writes a `ready` progress line with its address, which the cluster
agent publishes to the service registry.

    POST /v1/infer     {"inputs": [[16 floats], ...]} -> {"classes": [...], "replica": ...}
    GET  /healthz      200 once ready, 503 before and while draining
    GET  /v1/load      in-flight requests, queue depth, slots, served, errors, latency p50/p95/p99

A request takes one of `concurrency` slots for the forward pass and `compute_ms` of
accelerator time (a sleep where there is no GPU: this machine has none; the forward pass itself
runs in numpy); requests beyond the slots wait in the queue. SIGTERM drains: new requests get
503 (the router sends them elsewhere), the ones held finish, then it exits 0.

Environment (besides the workload contract's): FLEETLINE_MODEL (the model's name),
FLEETLINE_MODEL_PREFIX, FLEETLINE_SERVE_CONCURRENCY, FLEETLINE_SERVE_COMPUTE_MS,
FLEETLINE_SERVE_PORT (0: any free port), FLEETLINE_ADVERTISE_HOST (the address it listens on and is
reached at; the cluster agent passes its own, 127.0.0.1 unset), FLEETLINE_TLS_* (see tls.py;
the cluster agent passes its host's): with them it speaks TLS only, every caller must show a
certificate from the deployment's CA, and only the router's identity is served inference (its
own host's identity may also probe it and read its load); anyone else gets 403.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import os
import signal
import sys
import time
from collections import deque
from collections.abc import Mapping
from typing import Any

import numpy as np
from aiohttp import ClientSession, ClientTimeout, TCPConnector, web
from aiohttp.typedefs import Handler, Middleware

from fleetline.agents.router.listen import listen
from fleetline.agents.router.routing import percentile
from fleetline.agents.workloads.train import (
    Arrays,
    Progress,
    TrainConfig,
    checkpoints_from_env,
    initial,
    state_parts,
)
from fleetline.storage.checkpoints import params_digest
from fleetline.tls import TlsSettings, peer_identity

# Latencies kept for the percentiles /v1/load reports: the last window of requests.
LATENCY_WINDOW_S = 10.0


def model_seed(model: str) -> int:
    return int.from_bytes(hashlib.sha256(model.encode()).digest()[:4], "big")


def load_model(env: Mapping[str, str], progress: Progress) -> tuple[Arrays, str, float]:
    """(parameters, the checkpoint they came from, seconds it took): the newest complete
    checkpoint of the model, or the model built and saved there when it has none."""
    began = time.perf_counter()
    model = env.get("FLEETLINE_MODEL", "model")
    store = checkpoints_from_env(
        {**env, "FLEETLINE_CHECKPOINT_PREFIX": env.get("FLEETLINE_MODEL_PREFIX", f"models/{model}")}
    )
    found = store.latest()
    if found is None:
        config = TrainConfig(seed=model_seed(model))
        params, optimizer, rng = initial(config)
        manifest, _ = store.save(
            0, 0, state_parts(params, optimizer, rng, 0), {"params_sha256": params_digest(params)}
        )
        progress.write(event="model_saved", checkpoint=manifest.name, bytes=manifest.bytes)
        found = store.latest()
        assert found is not None, "a checkpoint just saved is complete"
    manifest, parts = found
    with np.load(io.BytesIO(parts["params.npz"]), allow_pickle=False) as loaded:
        params = {k: loaded[k] for k in loaded.files}
    return params, manifest.name, time.perf_counter() - began


def forward(params: Arrays, inputs: np.ndarray) -> list[int]:
    h = np.tanh(inputs @ params["w1"] + params["b1"])
    return [int(c) for c in np.argmax(h @ params["w2"] + params["b2"], axis=1)]


class Replica:
    """The server's state: readiness, slots, counters and the recent latencies."""

    def __init__(self, name: str, params: Arrays, concurrency: int, compute_s: float) -> None:
        self.name = name
        self.params = params
        self.features = int(params["w1"].shape[0])
        self.concurrency = concurrency
        self.compute_s = compute_s
        self.slots = asyncio.Semaphore(concurrency)
        self.ready = False
        self.draining = False
        self.inflight = 0  # requests being worked on or waiting
        self.busy = 0  # requests holding a slot
        self.served = 0
        self.errors = 0
        self.refused = 0  # requests that came before it was ready (the router sends none)
        self.turned_away = 0  # requests that came while it was draining (the router retries)
        self.forbidden = 0  # requests from an identity that may not ask (TLS only)
        self.latencies: deque[tuple[float, float]] = deque()  # (when, ms)

    def percentiles(self) -> dict[str, float | None]:
        now = time.monotonic()
        while self.latencies and self.latencies[0][0] < now - LATENCY_WINDOW_S:
            self.latencies.popleft()
        values = sorted(ms for _, ms in self.latencies)
        if not values:
            return {"p50": None, "p95": None, "p99": None}
        return {f"p{p}": round(percentile(values, p), 3) for p in (50, 95, 99)}

    def load(self) -> dict[str, Any]:
        return {
            "replica": self.name,
            "ready": self.ready and not self.draining,
            "draining": self.draining,
            "inflight": self.inflight,
            "queue": self.inflight - self.busy,
            "concurrency": self.concurrency,
            "served": self.served,
            "errors": self.errors,
            "refused": self.refused,
            "turned_away": self.turned_away,
            "forbidden": self.forbidden,
            "latency_ms": self.percentiles(),
        }

    async def infer(self, request: web.Request) -> web.Response:
        # Before it is ready only its own probe is answered.
        probe = request.headers.get("X-Fleetline-Probe") == "self"
        if self.draining or (not self.ready and not probe):
            if self.draining:
                self.turned_away += 1
            else:
                self.refused += 1
            return web.json_response(
                {"error": "draining" if self.draining else "not ready"}, status=503
            )
        began = time.perf_counter()
        self.inflight += 1
        try:
            body = await request.json()
            inputs = np.asarray(body.get("inputs") or [[0.0] * self.features], dtype=np.float64)
            if inputs.ndim != 2 or inputs.shape[1] != self.features or len(inputs) > 256:
                raise ValueError(f"inputs must be 1 to 256 rows of {self.features} numbers")
        except (ValueError, TypeError, AttributeError) as exc:
            self.inflight -= 1
            self.errors += 1
            return web.json_response({"error": f"bad request: {exc}"}, status=400)
        try:
            async with self.slots:
                self.busy += 1
                try:
                    classes = forward(self.params, inputs)
                    if self.compute_s:
                        await asyncio.sleep(self.compute_s)
                finally:
                    self.busy -= 1
        finally:
            self.inflight -= 1
        ms = (time.perf_counter() - began) * 1000
        self.served += 1
        self.latencies.append((time.monotonic(), ms))
        return web.json_response({"classes": classes, "replica": self.name, "ms": round(ms, 3)})

    async def healthz(self, request: web.Request) -> web.Response:
        ok = self.ready and not self.draining
        return web.json_response(self.load(), status=200 if ok else 503)

    async def load_handler(self, request: web.Request) -> web.Response:
        return web.json_response(self.load())

    def admission(self, tls: TlsSettings, own: str) -> Middleware:
        """Who may ask what, by the identity in the caller's verified certificate: inference
        from the router only (and the replica's own probe), the rest from the router or this
        host."""

        @web.middleware
        async def admit(request: web.Request, handler: Handler) -> web.StreamResponse:
            transport = request.transport
            peer = peer_identity(transport.get_extra_info("peercert") if transport else None)
            probe = request.headers.get("X-Fleetline-Probe") == "self"
            allowed = {tls.router_identity}
            if request.path != "/v1/infer" or probe:
                allowed.add(own)
            if peer not in allowed:
                self.forbidden += 1
                return web.json_response(
                    {
                        "error": f"{peer or 'a caller with no certificate'} may not "
                        f"{request.method} {request.path} here; only {tls.router_identity} may"
                    },
                    status=403,
                )
            return await handler(request)

        return admit


async def serve(env: Mapping[str, str]) -> int:
    progress = Progress(env.get("FLEETLINE_PROGRESS_FILE"))
    name = env.get("FLEETLINE_JOB", "replica")
    began = time.perf_counter()
    params, checkpoint, load_s = await asyncio.to_thread(load_model, env, progress)
    replica = Replica(
        name,
        params,
        int(env.get("FLEETLINE_SERVE_CONCURRENCY", "4")),
        float(env.get("FLEETLINE_SERVE_COMPUTE_MS", "20")) / 1000,
    )
    tls = TlsSettings.from_env(env)
    app = web.Application(middlewares=[replica.admission(tls, tls.identity())] if tls else [])
    app.router.add_post("/v1/infer", replica.infer)
    app.router.add_get("/healthz", replica.healthz)
    app.router.add_get("/v1/load", replica.load_handler)
    host = env.get("FLEETLINE_ADVERTISE_HOST") or "127.0.0.1"
    runner, address = await listen(
        app,
        host,
        int(env.get("FLEETLINE_SERVE_PORT", "0")),
        tls.server_context(verify_clients=True) if tls else None,
    )
    progress.write(event="listening", address=address)
    stopping = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stopping.set)
    # Ready only once a request has gone all the way through: the model answers.
    async with (
        ClientSession(
            timeout=ClientTimeout(total=5),
            connector=TCPConnector(ssl=tls.client_context() if tls else True),
        ) as session,
        session.post(
            f"{address}/v1/infer",
            data=json.dumps({"inputs": [[0.0] * replica.features]}),
            headers={"X-Fleetline-Probe": "self", "Content-Type": "application/json"},
        ) as answer,
    ):
        if answer.status != 200:
            progress.write(event="probe_failed", status=answer.status)
            return 1
    replica.ready = True
    progress.write(
        event="ready",
        address=address,
        checkpoint=checkpoint,
        load_s=round(load_s, 4),
        start_s=round(time.perf_counter() - began, 4),
    )
    await stopping.wait()
    replica.draining = True
    deadline = time.monotonic() + 10
    while replica.inflight and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    progress.write(
        event="stopped",
        served=replica.served,
        refused=replica.refused,
        turned_away=replica.turned_away,
    )
    await runner.cleanup()
    return 0


def main(env: Mapping[str, str] | None = None) -> int:
    return asyncio.run(serve(os.environ if env is None else env))


if __name__ == "__main__":
    sys.exit(main())
