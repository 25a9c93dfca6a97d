"""`fleetline load`: requests against the router on a diurnal curve per region, bounded.

Each region's rate follows a compressed day of `day_s` seconds: `night` of the peak between
dusk and dawn, rising on a sine to `peak_rps` x the region's weight at its local noon (regions
are offset by `offset_h` hours of that day); or, with `steps`, a piecewise-constant rate
(`[(at_s, rps), ...]`, the same curve for every region in its weight). Arrivals are open-loop
and deterministic (the rate integrated over 10 ms ticks), so a run is the same every time: what
it measures is the system's answer. It stops at `duration_s` or `max_requests`, whichever comes
first, never has more than `max_inflight` requests out, and only targets loopback addresses.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import math
import ssl
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

from aiohttp import ClientError, ClientSession, ClientTimeout, TCPConnector

from fleetline.agents.router.routing import percentile
from fleetline.errors import ConfigError

TICK_S = 0.01


def check_target(url: str, labs: Sequence[str] = ()) -> None:
    """Load goes to this machine only: loopback, or an address of a lab up on it (`labs`:
    their subnets)."""
    host = urlparse(url).hostname or ""
    try:
        address = ipaddress.ip_address(host)
        ok = address.is_loopback or any(address in ipaddress.ip_network(n) for n in labs)
    except ValueError:
        ok = host == "localhost"
    if not ok:
        raise ConfigError(
            f"fleetline load targets loopback or a lab's addresses only, not {host!r}"
        )


@dataclass(frozen=True)
class LoadPlan:
    router: str
    service: str  # tenant/name
    regions: Mapping[str, float]  # region -> weight of the peak
    peak_rps: float = 50.0
    day_s: float = 120.0
    night: float = 0.05
    offset_h: Mapping[str, float] = field(default_factory=dict)
    steps: Sequence[tuple[float, float]] = ()
    duration_s: float = 60.0
    max_requests: int = 100_000
    max_inflight: int = 512
    timeout_s: float = 10.0
    labs: tuple[str, ...] = ()  # subnets of the labs up on this machine: targets allowed
    token: str | None = None  # the bearer token the router asks for
    ca_file: str | None = None  # the CA an https:// router's certificate is checked against

    def rate(self, region: str, t: float) -> float:
        """Requests per second from `region` at `t` seconds into the run."""
        weight = self.regions[region]
        if self.steps:
            current = 0.0
            for at, rps in self.steps:
                if t >= at:
                    current = rps
            return current * weight
        hour = (t / self.day_s * 24 + self.offset_h.get(region, 0.0)) % 24
        daylight = max(0.0, math.sin(math.pi * (hour - 6) / 12))  # 06:00 to 18:00, noon peak
        return self.peak_rps * weight * (self.night + (1 - self.night) * daylight)


@dataclass
class Outcome:
    at_s: float
    region: str
    status: int
    ms: float
    replica: str | None
    tries: int


@dataclass
class LoadResult:
    outcomes: list[Outcome]
    skipped: int  # arrivals dropped because max_inflight requests were out
    seconds: float

    def summary(self, buckets: int = 12, span_s: float | None = None) -> dict[str, Any]:
        ok = sorted(o.ms for o in self.outcomes if o.status == 200)
        span = span_s or self.seconds or 1.0
        rows = []
        for b in range(buckets):
            lo, hi = span * b / buckets, span * (b + 1) / buckets
            part = [o for o in self.outcomes if lo <= o.at_s < hi]
            good = sorted(o.ms for o in part if o.status == 200)
            rows.append(
                {
                    "from_s": round(lo, 2),
                    "requests": len(part),
                    "ok": len(good),
                    "failed": len(part) - len(good),
                    "p50_ms": round(percentile(good, 50), 2) if good else None,
                    "p95_ms": round(percentile(good, 95), 2) if good else None,
                    "replicas": len({o.replica for o in part if o.replica}),
                }
            )
        return {
            "requests": len(self.outcomes),
            "ok": len(ok),
            "failed": sum(o.status != 200 for o in self.outcomes),
            "retried": sum(o.tries > 1 for o in self.outcomes),
            "statuses": {
                str(code): sum(o.status == code for o in self.outcomes)
                for code in sorted({o.status for o in self.outcomes})
            },
            "skipped": self.skipped,
            "seconds": round(self.seconds, 2),
            "p50_ms": round(percentile(ok, 50), 2) if ok else None,
            "p95_ms": round(percentile(ok, 95), 2) if ok else None,
            "p99_ms": round(percentile(ok, 99), 2) if ok else None,
            "by_region": {
                r: sum(o.region == r for o in self.outcomes)
                for r in sorted({o.region for o in self.outcomes})
            },
            "buckets": rows,
        }


async def run_load(plan: LoadPlan) -> LoadResult:
    check_target(plan.router, plan.labs)
    tenant, _, name = plan.service.partition("/")
    url = f"{plan.router.rstrip('/')}/v1/services/{tenant}/{name}/infer"
    body = json.dumps({"inputs": [[0.1] * 16]}).encode()
    outcomes: list[Outcome] = []
    owed = dict.fromkeys(plan.regions, 0.0)
    inflight = 0
    skipped = 0
    tasks: set[asyncio.Task[None]] = set()
    headers = {"Content-Type": "application/json"}
    if plan.token:
        headers["Authorization"] = f"Bearer {plan.token}"
    trust = ssl.create_default_context(cafile=plan.ca_file) if plan.ca_file else True
    async with ClientSession(
        connector=TCPConnector(limit=0, ssl=trust), timeout=ClientTimeout(total=plan.timeout_s)
    ) as session:

        async def one(region: str, at: float) -> None:
            nonlocal inflight
            began = time.perf_counter()
            status, replica, tries = 0, None, 0
            try:
                async with session.post(
                    url,
                    data=body,
                    headers={**headers, "X-Fleetline-Region": region},
                ) as answer:
                    await answer.read()
                    status = answer.status
                    replica = answer.headers.get("X-Fleetline-Replica")
                    tries = int(answer.headers.get("X-Fleetline-Tries", "0"))
            except (ClientError, TimeoutError, OSError):
                status = 0
            finally:
                inflight -= 1
            outcomes.append(
                Outcome(at, region, status, (time.perf_counter() - began) * 1000, replica, tries)
            )

        start = time.monotonic()
        sent = 0
        tick = 0
        while sent < plan.max_requests:
            t = tick * TICK_S
            if t >= plan.duration_s:
                break
            delay = start + t - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            for region in plan.regions:
                owed[region] += plan.rate(region, t) * TICK_S
                while owed[region] >= 1 and sent < plan.max_requests:
                    owed[region] -= 1
                    if inflight >= plan.max_inflight:
                        skipped += 1
                        continue
                    inflight += 1
                    sent += 1
                    task = asyncio.create_task(one(region, t))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
            tick += 1
        if tasks:
            await asyncio.gather(*tasks)
        seconds = time.monotonic() - start
    return LoadResult(sorted(outcomes, key=lambda o: o.at_s), skipped, seconds)
