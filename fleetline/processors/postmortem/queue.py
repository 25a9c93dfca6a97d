"""What would make each queued job fit, asked of the scheduler's committed state (its
changelog's records, over the view at the offsets its last TICK named): for `explain
--queued`, the API and the console. The scheduler is rebuilt from a copy of the records, so
the live one is never touched."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

from fleetline.processors.postmortem.fit import Fit, what_would_fit
from fleetline.processors.scheduling.capacity import FleetFacts, observe
from fleetline.processors.scheduling.codec import canonical_json
from fleetline.processors.scheduling.scheduler import Scheduler
from fleetline.processors.view.model import ResourceView
from fleetline.streams.records import Offsets


def committed_fits(
    records: Mapping[str, Any], facts_at: Callable[[Offsets], FleetFacts]
) -> list[Fit]:
    """Every queued job's binding constraint and the change that would place it."""
    if not records:
        return []
    copied = {key: json.loads(canonical_json(value)) for key, value in records.items()}
    offsets = Scheduler.view_offsets_of(copied)
    facts = facts_at(offsets) if offsets else observe(ResourceView())
    return what_would_fit(Scheduler.from_records(copied, facts))
