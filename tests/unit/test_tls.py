"""The router and an inference replica over mutual TLS with the deployment's CA, and the
router's token check on inference (in one process on loopback; tests/chaos/test_link_cuts.py
does it across the lab's hosts)."""

from __future__ import annotations

import asyncio
import json
import ssl
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
from aiohttp import ClientOSError, ClientSession, TCPConnector, web

from fleetline.agents.router.listen import listen
from fleetline.agents.router.server import Router
from fleetline.agents.workloads.serve import Replica
from fleetline.agents.workloads.train import TrainConfig, initial
from fleetline.api.auth import AuthConfig, Authenticator, inference_admission, token_digest
from fleetline.config import Settings
from fleetline.errors import ConfigError
from fleetline.infra import ca
from fleetline.streams.topics import Topics
from fleetline.tls import TlsSettings

TOKENS = {
    "acme-user": ("user", "acme"),
    "globex-user": ("user", "globex"),
    "acme-eye": ("viewer", "acme"),
}


def _tls(issued: ca.Issued) -> TlsSettings:
    return TlsSettings(issued.ca, issued.cert, issued.key)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TlsSettings]:
    ours, theirs = tmp_path_factory.mktemp("ca"), tmp_path_factory.mktemp("other-ca")
    ca.init(ours)
    ca.init(theirs)
    return {
        "router": _tls(ca.issue(ours, "router", ["127.0.0.1"])),
        "cluster": _tls(ca.issue(ours, "eu-west-a", ["127.0.0.1", "localhost"])),
        "mallory": _tls(ca.issue(ours, "mallory", ["127.0.0.1"])),
        # Our CA's certificate for an address the replica is not reached at.
        "elsewhere": _tls(ca.issue(ours, "eu-west-b", ["10.99.0.7"])),
        "stranger": _tls(ca.issue(theirs, "router", ["127.0.0.1"])),
    }


@asynccontextmanager
async def replica_at(tls: TlsSettings) -> AsyncIterator[tuple[Replica, str]]:
    params, _, _ = initial(TrainConfig(seed=1))
    replica = Replica("acme/chat-0", params, concurrency=2, compute_s=0.0)
    replica.ready = True
    app = web.Application(middlewares=[replica.admission(tls, tls.identity())])
    app.router.add_post("/v1/infer", replica.infer)
    app.router.add_get("/v1/load", replica.load_handler)
    runner, address = await listen(app, "127.0.0.1", 0, tls.server_context(verify_clients=True))
    try:
        yield replica, address
    finally:
        await runner.cleanup()


def _registry_record(address: str) -> dict:
    return {
        "replica": "acme/chat-0",
        "service": "acme/chat",
        "cluster_id": "eu-west-a",
        "region": "eu-west",
        "state": "READY",
        "address": address,
        "epoch": 1,
        "attempt": 1,
        "ts": int(time.time() * 1000),
        "heartbeat_ms": 600_000,
    }


@asynccontextmanager
async def router_to(tls: TlsSettings, replica_address: str) -> AsyncIterator[Router]:
    tokens = [
        {"name": name, "sha256": token_digest(name), "role": role, "tenant": tenant}
        for name, (role, tenant) in TOKENS.items()
    ]
    admit = inference_admission(Authenticator(AuthConfig.from_data({"tokens": tokens})))
    router = Router(Settings(tls=tls), Topics("tls-test"), report=False, admit=admit)
    router.registry.apply(_registry_record(replica_address))
    stop = threading.Event()
    serving = asyncio.create_task(router.serve("127.0.0.1", 0, stop))
    while router.address is None:
        await asyncio.sleep(0.01)
    try:
        yield router
    finally:
        stop.set()
        await serving


def client(tls: TlsSettings | None, trust: Path | None = None) -> ClientSession:
    """A session that shows `tls`'s certificate (none: no certificate) and trusts `trust`
    (default: the CA that issued it)."""
    context = ssl.create_default_context(cafile=str(trust or (tls and tls.ca)))
    if tls is not None:
        context.load_cert_chain(tls.cert, tls.key)
    return ClientSession(connector=TCPConnector(ssl=context))


BODY = json.dumps({"inputs": [[0.1] * 16]})


async def _post(session: ClientSession, url: str, token: str | None = None) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    async with session.post(url, data=BODY, headers=headers) as answer:
        return answer.status, await answer.json()


def test_the_router_serves_a_tenants_token_over_tls_and_refuses_the_rest(pki) -> None:
    async def scenario() -> None:
        async with (
            replica_at(pki["cluster"]) as (replica, address),
            router_to(pki["router"], address) as router,
            client(None, trust=pki["router"].ca) as caller,
        ):
            assert router.address is not None and router.address.startswith("https://")
            url = f"{router.address}/v1/services/acme/chat/infer"
            status, body = await _post(caller, url, "acme-user")
            assert status == 200 and body["replica"] == "acme/chat-0", body
            assert len(body["classes"]) == 1

            assert (await _post(caller, url))[0] == 401
            status, body = await _post(caller, url, "not-a-token")
            assert status == 401 and "unknown API token" in body["error"]
            # Another tenant's token, and a role that may only look.
            status, body = await _post(caller, url, "globex-user")
            assert status == 403 and "only reach tenant globex" in body["error"], body
            status, body = await _post(caller, url, "acme-eye")
            assert status == 403 and "viewer" in body["error"], body
            assert replica.served == 1  # nothing refused reached the replica
            assert router.counters.unauthenticated == 2 and router.counters.forbidden == 2

    asyncio.run(scenario())


def test_a_replica_serves_only_the_routers_identity(pki) -> None:
    async def scenario() -> None:
        async with replica_at(pki["cluster"]) as (replica, address):
            infer, load = f"{address}/v1/infer", f"{address}/v1/load"
            async with client(pki["router"]) as router:
                assert (await _post(router, infer))[0] == 200
            # Another identity from the same CA: through the handshake, refused.
            async with client(pki["mallory"]) as mallory:
                status, body = await _post(mallory, infer)
                assert status == 403 and "mallory may not" in body["error"], body
                async with mallory.get(load) as answer:
                    assert answer.status == 403
            # Its own host (the cluster agent) reads its load, but is not served inference.
            async with client(pki["cluster"]) as own:
                async with own.get(load) as answer:
                    assert answer.status == 200 and (await answer.json())["forbidden"] == 2
                assert (await _post(own, infer))[0] == 403
            # No certificate, or one from another CA: the handshake fails (under TLS 1.3 the
            # client learns it when the server resets the connection).
            for stranger in (None, pki["stranger"]):
                async with client(stranger, trust=pki["router"].ca) as session:
                    with pytest.raises(ClientOSError):
                        await _post(session, infer)
            assert replica.served == 1

    asyncio.run(scenario())


def test_the_router_refuses_a_replica_whose_certificate_names_another_address(pki) -> None:
    async def scenario() -> None:
        async with (
            replica_at(pki["elsewhere"]) as (replica, address),
            router_to(pki["router"], address) as router,
            client(None, trust=pki["router"].ca) as caller,
        ):
            url = f"{router.address}/v1/services/acme/chat/infer"
            status, body = await _post(caller, url, "acme-user")
            assert status == 503, body
            assert "certificate" in body["error"].lower(), body
            assert replica.served == 0

    asyncio.run(scenario())


def test_tls_settings_and_the_ca_refuse_bad_input(tmp_path, pki) -> None:
    with pytest.raises(ConfigError, match="FLEETLINE_TLS_KEY unset"):
        TlsSettings.from_env({"FLEETLINE_TLS_CA": "a", "FLEETLINE_TLS_CERT": "b"})
    with pytest.raises(ConfigError, match="is not a file"):
        TlsSettings.from_env(
            {"FLEETLINE_TLS_CA": "/nope", "FLEETLINE_TLS_CERT": "b", "FLEETLINE_TLS_KEY": "c"}
        )
    assert TlsSettings.from_env({}) is None
    env = pki["router"].as_env()
    assert TlsSettings.from_env(env) == pki["router"]
    assert Settings.from_env(env).tls == pki["router"]
    with pytest.raises(ConfigError, match="no CA in"):
        ca.issue(tmp_path, "router", ["127.0.0.1"])
    ca.init(tmp_path)
    with pytest.raises(ConfigError, match="identity 'Router!'"):
        ca.issue(tmp_path, "Router!", ["127.0.0.1"])
    with pytest.raises(ConfigError, match="wildcard"):
        ca.issue(tmp_path, "router", ["0.0.0.0"])
    with pytest.raises(ConfigError, match="at least one"):
        ca.issue(tmp_path, "router", [])
    # A certificate with another's key does not load.
    mixed = TlsSettings(pki["router"].ca, pki["router"].cert, pki["mallory"].key)
    with pytest.raises(ConfigError, match="FLEETLINE_TLS_CERT/KEY"):
        mixed.client_context()
    assert (tmp_path / "ca-key.pem").stat().st_mode & 0o077 == 0


def test_run_gives_each_cluster_agent_a_certificate_of_its_own(tmp_path) -> None:
    from fleetline.demo.cluster_story import ClusterAgents

    authority = tmp_path / "ca"
    router = ca.deployment_identity(authority, "router", ["127.0.0.1"])
    settings = Settings(tls=router.settings(), object_encryption_key="a2V5")
    agents = ClusterAgents(
        settings, Topics("tls-test"), ["eu-west-a"], state_dir=tmp_path, authority=authority
    )
    own = agents.settings_of("eu-west-a", ["127.0.0.1", "localhost"]).tls
    assert own is not None and own.identity() == "eu-west-a"
    # Issued by the router's CA, so each trusts the other; the router stays the one identity
    # a replica serves inference to.
    assert own.ca == router.ca and own.router_identity == "router"
    own.client_context()
    # Without a CA to issue from, every agent shares the settings' certificate.
    shared = ClusterAgents(settings, Topics("tls-test"), ["eu-west-a"], state_dir=tmp_path)
    assert shared.settings_of("eu-west-a", ["127.0.0.1"]).tls == router.settings()
