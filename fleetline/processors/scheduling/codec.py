"""The scheduler's events as records: requests in, effects out (pure; the shell encodes them)."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from fleetline.processors.scheduling.effects import (
    AllocationChange,
    DatasetRecord,
    Decision,
    Effect,
    PrewarmOrder,
    WorkloadOrder,
)
from fleetline.processors.scheduling.requests import RequestKind
from fleetline.processors.scheduling.specs import Spec
from fleetline.processors.scheduling.state import spec_key
from fleetline.streams.events import (
    ALLOCATION,
    DATASET_PREWARM,
    DATASET_STATE,
    SCHEDULING_DECISION,
    WORKLOAD_ORDER,
)

Offsets = Mapping[str, Mapping[int, int]]


def new_request(
    kind: str,
    key: str,
    tenant: str,
    ts: int,
    request_id: str,
    *,
    actor: str = "",
    spec_json: str | None = None,
    phase: str | None = None,
    checkpoint_ms: int | None = None,
    view_offsets: Offsets | None = None,
    cluster_id: str | None = None,
    epoch: int | None = None,
    attempt: int | None = None,
    exit_code: int | None = None,
    step: int | None = None,
    detail: str | None = None,
    traceparent: str | None = None,
) -> dict[str, Any]:
    """A SchedulerRequest record."""
    if kind not in tuple(RequestKind):
        raise ValueError(f"unknown request kind {kind!r}")
    return {
        "request_id": request_id,
        "kind": kind,
        "key": key,
        "tenant": tenant,
        "ts": ts,
        "actor": actor,
        "spec_json": spec_json,
        "phase": phase,
        "checkpoint_ms": checkpoint_ms,
        "view_offsets": [
            {"topic": t, "partition": p, "offset": o}
            for t, ps in sorted((view_offsets or {}).items())
            for p, o in sorted(ps.items())
        ],
        "cluster_id": cluster_id,
        "epoch": epoch,
        "attempt": attempt,
        "exit_code": exit_code,
        "step": step,
        "detail": detail,
        "traceparent": traceparent,
    }


def order_report(
    order: WorkloadOrder, phase: str, ts: int, request_id: str, exit_code: int | None = None
) -> dict[str, Any]:
    """A cluster agent's PROGRESS report on the run `order` started, at `ts`."""
    return new_request(
        "PROGRESS",
        order.job,
        order.tenant,
        ts,
        request_id,
        phase=phase,
        cluster_id=order.cluster_id,
        epoch=order.epoch,
        attempt=order.attempt,
        exit_code=exit_code,
    )


def canonical_json(document: Any) -> str:
    return json.dumps(document, sort_keys=True, separators=(",", ":"))


def submit_request(
    spec: Spec,
    document: Mapping[str, Any],
    ts: int,
    request_id: str,
    actor: str = "",
    traceparent: str | None = None,
) -> dict[str, Any]:
    return new_request(
        "SUBMIT",
        spec_key(spec),
        spec.metadata.tenant,
        ts,
        request_id,
        actor=actor,
        spec_json=canonical_json(document),
        traceparent=traceparent,
    )


def datasets_first(specs: Sequence[Spec], documents: Sequence[Any]) -> list[tuple[Spec, Any]]:
    """Specs in the order to submit them: datasets before the jobs that may read them."""
    pairs = list(zip(specs, documents, strict=True))
    return [p for p in pairs if p[0].kind == "Dataset"] + [
        p for p in pairs if p[0].kind != "Dataset"
    ]


def spec_requests(
    specs: Sequence[Spec],
    documents: Sequence[Mapping[str, Any]],
    ts: int,
    actor: str,
    request_id: Callable[[], str],
    traceparent: Callable[[], str | None],
) -> list[tuple[Spec, dict[str, Any]]]:
    """The SUBMIT request of each parsed spec, datasets first, each with the id and trace its
    caller gives (the API and `apply`: one trace for all; the demo: one each). Every way specs
    are submitted goes through here."""
    return [
        (spec, submit_request(spec, doc, ts, request_id(), actor, traceparent()))
        for spec, doc in datasets_first(specs, documents)
    ]


def offsets_of(request: Mapping[str, Any]) -> dict[str, dict[int, int]]:
    out: dict[str, dict[int, int]] = {}
    for item in request["view_offsets"]:
        out.setdefault(item["topic"], {})[item["partition"]] = item["offset"]
    return out


def effect_record(effect: Effect) -> tuple[str, str, dict[str, Any]]:
    """(record name, message key, record) of an effect."""
    match effect:
        case Decision():
            return SCHEDULING_DECISION, effect.job, effect.as_record()
        case AllocationChange():
            return (
                ALLOCATION,
                effect.job,
                {
                    "job_id": effect.job,
                    "tenant": effect.tenant,
                    "seq": effect.seq,
                    "ts": effect.ts,
                    "kind": effect.kind,
                    "cluster_id": effect.cluster_id,
                    "gpus": [{"node_id": n, "gpu_index": i} for n, i in effect.gpus],
                    "priority": effect.priority,
                    "reason": effect.reason,
                    "share_eighths": effect.share_eighths,
                },
            )
        case PrewarmOrder():
            p = effect.prewarm
            return (
                DATASET_PREWARM,
                f"{p.dataset_id}@{p.to_cluster}",
                {
                    "dataset_id": p.dataset_id,
                    "tenant": effect.tenant,
                    "job": effect.job,
                    "decision_id": effect.decision_id,
                    "ts": effect.ts,
                    "from_cluster": p.from_cluster,
                    "to_cluster": p.to_cluster,
                    "size_bytes": p.size_bytes,
                    "estimated_s": p.estimated_s,
                    "rate_gbps": p.rate_gbps,
                    "prefix": effect.prefix,
                    "mask_fields": list(effect.mask_fields),
                },
            )
        case DatasetRecord():
            return (
                DATASET_STATE,
                effect.dataset_id,
                {
                    "dataset_id": effect.dataset_id,
                    "tenant": effect.tenant,
                    "seq": effect.seq,
                    "ts": effect.ts,
                    "size_bytes": effect.size_bytes,
                    "replicas": list(effect.replicas),
                    "deleted": effect.deleted,
                },
            )
        case WorkloadOrder():
            return WORKLOAD_ORDER, effect.job, effect.as_record()
        case _:
            raise TypeError(f"not a scheduler effect: {effect!r}")
