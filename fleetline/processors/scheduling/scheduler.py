"""The scheduler as event handlers: a deterministic fold of its request log into decisions.

`Scheduler.step(request, position, facts)` handles one request from
`<prefix>.scheduler.requests` (one partition, so one total order) and returns what it decided
as data (`effects.py`): decisions with their reasons, the view position they read and the
alternatives' scores; allocation records for the resource view; dataset prewarms and dataset
records. It reads no clock and draws no random numbers: time is the requests' event time (a
monotone maximum), ids come from the request's log position, and the fleet is what
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
from fleetline.processors.scheduling import reconcile, requests
from fleetline.processors.scheduling.capacity import FleetFacts
from fleetline.processors.scheduling.effects import Effect, EffectLog
from fleetline.processors.scheduling.requests import RequestKind
from fleetline.processors.scheduling.state import SchedulerState, view_offsets_of


class Scheduler(SchedulerState):
    """The scheduler's state and the step that folds one request into it."""

    def step(
        self, request: Mapping[str, Any], position: int, facts: FleetFacts | None = None
    ) -> list[Effect]:
        """Fold one request at log `position`; `facts` is the view observed at the offsets a
        TICK names (required for TICKs, ignored otherwise)."""
        out = EffectLog(position)
        self.position = position
        self.dirty.add("meta")
        # Victims are cached within one request only: a priority or a checkpoint that changed
        # in the same millisecond must not be read stale, and a scheduler restored from its
        # changelog (with no cache) must decide what the running one decided.
        self.victim_cache.clear()
        if request["ts"] > self.now_ms:
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

    @classmethod
    def from_records(cls, records: Mapping[str, Any], facts: FleetFacts) -> Scheduler:
        """The state the changelog records describe, over the view facts it last observed."""
        scheduler = cls(None, facts)
        scheduler.restore(records)
        return scheduler

    view_offsets_of = staticmethod(view_offsets_of)
