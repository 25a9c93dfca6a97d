"""The scheduler as event handlers: a deterministic fold of its request log into decisions.

`Scheduler.step(request, position, facts)` handles one request from
`<prefix>.scheduler.requests` (one partition, so one total order) and returns what it decided
as data (`effects.py`): decisions with their reasons, the view position they read and the
alternatives' scores; allocation records for the resource view; dataset prewarms and dataset
records. It reads no clock and draws no random numbers: time is the event time of the control
plane's requests (a monotone maximum; an agent's report moves nothing), ids come from the
request's log position, each request's writer is what the gate established (a request its
writer may not make is refused, identity/authority.py), and the fleet is what
`observe(view)` saw at the offsets a TICK names. So folding the same requests with the views at
the same offsets gives the same effects, byte for byte; `fleetline replay --decisions` checks
that against the log.

The state is `state.py`; the handlers of each request kind are `requests.py`; TICK, the
reconcile loop, is `reconcile.py`; placing, binding, releasing and preempting are `decide.py`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fleetline.errors import InvalidEventError
from fleetline.identity.authority import request_refusal
from fleetline.identity.writers import CONTROL_PLANE_WRITER, Writer, WriterRefused
from fleetline.processors.scheduling import reconcile, requests
from fleetline.processors.scheduling.capacity import FleetFacts
from fleetline.processors.scheduling.effects import Effect, EffectLog
from fleetline.processors.scheduling.requests import RequestKind
from fleetline.processors.scheduling.state import Job, SchedulerState, view_offsets_of


def _ordered_clusters(job: Job) -> set[str]:
    """The clusters the job was ordered to: its current placement's (a split job's several)
    and those it ran in before (a stopped run's final checkpoint, a fenced copy's report)."""
    ordered = job.ordered_cluster
    return {*job.allocation, *job.ran_in, *([ordered] if ordered else [])}


class Scheduler(SchedulerState):
    """The scheduler's state and the step that folds one request into it."""

    def step(
        self,
        request: Mapping[str, Any],
        position: int,
        facts: FleetFacts | None = None,
        writer: Writer = CONTROL_PLANE_WRITER,
    ) -> list[Effect]:
        """Fold one request at log `position`; `facts` is the view observed at the offsets a
        TICK names (required for TICKs, ignored otherwise). `writer` is who wrote it, as the
        gate established it: a request it may not make raises WriterRefused and changes
        nothing. Only the control plane's requests move the clock (an agent's clock is its
        own, and one running ahead must not age every deadline and backoff)."""
        refusal = self.refusal(writer, request)
        if refusal is not None:
            raise WriterRefused(writer.header, refusal)
        out = EffectLog(position)
        self.position = position
        self.dirty.add("meta")
        # Victims are cached within one request only: a priority or a checkpoint that changed
        # in the same millisecond must not be read stale, and a scheduler restored from its
        # changelog (with no cache) must decide what the running one decided.
        self.victim_cache.clear()
        if writer.is_control_plane and request["ts"] > self.now_ms:
            self.now_ms = request["ts"]
        match request["kind"]:
            case RequestKind.SUBMIT:
                requests.submit(self, out, request)
            case RequestKind.DELETE:
                requests.delete(self, out, request)
            case RequestKind.PROGRESS:
                requests.progress(self, out, request)
            case RequestKind.TENANT_POLICY:
                requests.tenant_policy(self, out, request)
            case RequestKind.POLICY:
                requests.scheduling_policy(self, out, request)
            case RequestKind.DATASET_READY:
                requests.dataset_ready(self, out, request)
            case RequestKind.DATASET_PROGRESS:
                requests.dataset_progress(self, out, request)
            case RequestKind.FENCE:
                requests.fence_node(self, out, request)
            case RequestKind.UNFENCE:
                requests.unfence_node(self, out, request)
            case RequestKind.ENERGY:
                requests.energy_profile(self, out, request)
            case RequestKind.SERVICE_LOAD:
                requests.service_load(self, out, request)
            case RequestKind.TICK:
                if facts is None:
                    raise InvalidEventError("a TICK needs the view observed at its offsets")
                reconcile.tick(self, out, facts)
            case other:
                raise InvalidEventError(f"the scheduler does not handle {other} requests")
        return out.effects

    def refusal(self, writer: Writer, request: Mapping[str, Any]) -> str | None:
        """Why `writer` may not make `request` (identity/authority.py), from this state."""
        if writer.is_control_plane:
            return None
        kind, key = request["kind"], request["key"]
        job = self.jobs.get(key)
        tenant = request.get("tenant") or ""
        # (reads only: a refused request must leave no trace in the state)
        node = self.facts.nodes.get(key) if kind in ("FENCE", "UNFENCE") else None
        return request_refusal(
            writer,
            kind,
            cluster_id=request.get("cluster_id"),
            ordered_clusters=_ordered_clusters(job) if job is not None else (),
            copy_ordered=key in (usage.prewarms if (usage := self.usage.get(tenant)) else ()),
            is_service=job is not None and job.is_service,
            node_cluster=node.cluster_id if node is not None else None,
        )

    @classmethod
    def from_records(cls, records: Mapping[str, Any], facts: FleetFacts) -> Scheduler:
        """The state the changelog records describe, over the view facts it last observed."""
        scheduler = cls(None, facts)
        scheduler.restore(records)
        return scheduler

    view_offsets_of = staticmethod(view_offsets_of)
