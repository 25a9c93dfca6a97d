"""The imperative shell around the operations fold: the operations log in; node commands,
scheduler FENCE / UNFENCE requests, ticket changes and audit events out, exactly once.

`OpsService` runs the fold in the stream loop over its single-partition log, its state in a
store backed by a compacted changelog (written in the same transaction as its outputs), and a
ticker that reads the live resource view every `tick_interval_s`, applies the healing rules
(`rules.observe`) and appends what it saw as an OBSERVE event: the findings with their evidence
and the node loads that changed since the last one. The fold decides on those events alone, so
`fleetline replay` of the log would decide the same.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from confluent_kafka import Message

from fleetline.config import KafkaSettings, mapping_file
from fleetline.errors import ConfigError, FleetlineError, InvalidEventError
from fleetline.processors.audit.runtime import new_event
from fleetline.processors.operations.fold import (
    Audited,
    Command,
    Effect,
    OpsFold,
    OpsKind,
    OpsPolicy,
    SchedulerCall,
    TicketChanged,
    check_move,
)
from fleetline.processors.operations.rules import (
    READING_RULES,
    Finding,
    HealingRules,
    NodeLoad,
    Observation,
    observe,
)
from fleetline.processors.operations.tuning import Recommendation, recommend
from fleetline.processors.scheduling.client import read_topic, request_output
from fleetline.processors.scheduling.codec import new_request
from fleetline.processors.view.read import ViewSource
from fleetline.schemas.records import CommandKind, NodeCommand, OpsEvent, RepairTicket
from fleetline.schemas.records import OpsKind as OpsEventKind
from fleetline.streams import kafka as kafka_clients
from fleetline.streams.events import AUDIT_EVENT, NODE_COMMAND, OPS_EVENT, REPAIR_TICKET
from fleetline.streams.loop import (
    FoldService,
    FoldStep,
    deliver,
    fold_loop,
    produce,
    wait_for,
)
from fleetline.streams.records import Output, where
from fleetline.streams.serde import AvroCodec, default_codec
from fleetline.streams.store import FOLD_STORE, ChangelogStore, fold_changelog, fold_store
from fleetline.streams.topics import Topics, TopicSpec

log = logging.getLogger(__name__)

APPLICATION_ID = "operations"
LOADS_PER_EVENT = 4000  # ~40 bytes of JSON a node
STORE = FOLD_STORE


def changelog(topics: Topics) -> TopicSpec:
    """The operations fold's state changelog, as the composition root creates it."""
    return fold_changelog(topics, APPLICATION_ID)


def ops_event(
    kind: str, ts: int, payload: Mapping[str, Any], *, key: str = "", actor: str = ""
) -> OpsEvent:
    """An OpsEvent record."""
    if kind not in tuple(OpsKind):
        raise ValueError(f"unknown operations event kind {kind!r}")
    return {
        "event_id": uuid.uuid4().hex,
        "kind": cast(OpsEventKind, kind),  # checked just above
        "ts": ts,
        "key": key,
        "actor": actor,
        "payload_json": json.dumps(payload, sort_keys=True, separators=(",", ":")),
    }


def ops_output(topics: Topics, event: Mapping[str, Any], codec: AvroCodec) -> Output:
    return Output(
        topics.ops,
        (event["key"] or "-").encode(),
        codec.encode(topics.record_of(topics.ops), event),
    )


def command_record(command: Command) -> NodeCommand:
    """A node command as the NodeCommand record its agent reads (the reason rides in the
    config map, which only APPLY_CONFIG applies)."""
    return {
        "command_id": command.command_id,
        "cluster_id": command.cluster_id,
        "node_id": command.node_id,
        "ts": command.ts,
        "issued_by": "operations",
        "kind": cast(CommandKind, command.kind),  # the fold issues only the schema's kinds
        "power_cap_w": command.power_cap_w,
        "config_version": None,
        "config": {"reason": command.reason},
    }


def ticket_record(ticket: Mapping[str, Any]) -> RepairTicket:
    """A ticket as the RepairTicket record on the tickets topic."""
    return {
        "ticket_id": ticket["ticket_id"],
        "node_id": ticket["node_id"],
        "cluster_id": ticket["cluster_id"],
        "rule": ticket["rule"],
        "severity": ticket["severity"],
        "summary": ticket["summary"],
        "state": ticket["state"],
        "opened_ms": ticket["opened_ms"],
        "updated_ms": ticket["updated_ms"],
        "seq": ticket["seq"],
        "reason": ticket["reason"],
        "burn_in_until_ms": ticket["burn_in_until_ms"],
        "evidence_json": json.dumps(ticket["evidence"], sort_keys=True),
        "history_json": json.dumps(ticket["history"], sort_keys=True),
    }


def ticket_from_record(record: Mapping[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in record.items() if not k.endswith("_json")}
    out["evidence"] = json.loads(record["evidence_json"])
    out["history"] = json.loads(record["history_json"])
    return out


def committed(store: ChangelogStore[Any]) -> OpsFold:
    """The fold as its store holds it (an empty store: a fresh fold)."""
    return OpsFold.from_records({key.decode(): value for key, value in store.items([0])})


class OpsStep(FoldStep[OpsFold]):
    """Folds one operations event; its effects and the fold's changed records go out in one
    transaction."""

    def __init__(
        self, topics: Topics, store: ChangelogStore[Any], codec: AvroCodec | None = None
    ) -> None:
        super().__init__()
        self.topics = topics
        self.state = store
        self.stores = [store]
        self.codec = codec or default_codec()

    def restore_fold(self) -> OpsFold:
        return committed(self.state)

    def handle(self, message: Message) -> Sequence[Output]:
        _, _, offset = where(message)
        with self.lock:
            fold = self.fold()
            event = self.codec.decode(message.value(), expect=OPS_EVENT).record
            try:
                effects = fold.step(event, offset)
            finally:
                for key, value in fold.drain_dirty():
                    self.state.put(0, key.encode(), value)
            return [self._output(e) for e in effects]

    def _output(self, effect: Effect) -> Output:
        if isinstance(effect, Command):
            record = command_record(effect)
            return Output(
                self.topics.commands,
                effect.node_id.encode(),
                self.codec.encode(NODE_COMMAND, record),
            )
        if isinstance(effect, SchedulerCall):
            request = new_request(
                effect.kind,
                effect.key,
                effect.tenant,
                effect.ts,
                effect.request_id,
                actor="operations",
                detail=effect.reason,
                spec_json=effect.spec_json,
            )
            return request_output(self.topics, request, self.codec)
        if isinstance(effect, TicketChanged):
            ticket = ticket_record(effect.ticket)
            return Output(
                self.topics.tickets,
                ticket["ticket_id"].encode(),
                self.codec.encode(self.topics.record_of(self.topics.tickets), ticket),
            )
        assert isinstance(effect, Audited)
        event = new_event(
            ts=effect.ts,
            actor="operations",
            actor_role="service",
            operation=effect.operation,
            target=effect.target,
            outcome="SUCCEEDED",
            request_id=effect.event_id,
            source="operations",
            details=effect.details,
        )
        # The id follows from the log position: a redelivered batch chains it once.
        event["event_id"] = effect.event_id
        return Output(self.topics.audit_requests, b"_fleet", self.codec.encode(AUDIT_EVENT, event))


@dataclass
class OpsService(FoldService):
    """The operations fold's loop plus its ticker over the view."""

    side_name = "operations-tick"

    kafka: KafkaSettings
    topics: Topics
    view: ViewSource
    rules: HealingRules = field(default_factory=HealingRules)
    policy: OpsPolicy | None = None
    tick_interval_s: float = 1.0
    instance_id: str = "0"
    clock: Callable[[], int] = field(default=lambda: int(time.time() * 1000))
    ticking: threading.Event = field(default_factory=threading.Event)
    # With no new finding and no load change, time still moves the fold (burn-ins, idle
    # timers) through one OBSERVE this often; every OBSERVE carries every current finding.
    quiet_every_s: float = 10.0
    # Silence and GPU health are judged every tick (a node whose epoch has not moved costs a
    # lookup); the thresholds on every GPU's readings, a scan of all samples, this often.
    readings_every_s: float = 5.0
    # Tuning on the processor's own schedule: every `recommend_every_s`, the recommendations
    # `recommend` makes from the stored history (`recommendation_events`), appended to its own
    # log as the operations processor's (applied there when its policy says so). None: off.
    recommend: Callable[[int], list[OpsEvent]] | None = None
    recommend_every_s: float = 3600.0

    def __post_init__(self) -> None:
        self.store = fold_store(self.topics, APPLICATION_ID)
        self.step = OpsStep(self.topics, self.store)
        self.loop = fold_loop(
            self.kafka,
            self.topics,
            APPLICATION_ID,
            self.topics.ops,
            self.step,
            self.instance_id,
            max_messages=200,
        )
        self.name = self.loop.name
        self.ready = self.loop.ready
        self.ticks = 0
        self.recommended = 0
        self._sent: dict[str, NodeLoad] = {}
        self._found: list[tuple[str, str, str]] = []
        self._skipped: list[str] = []
        self._observed_at = float("-inf")
        self._read_at = float("-inf")
        self._limits: dict[str, float] = {}
        self._from_readings: list[Finding] = []
        self._health: dict[str, tuple[int, list[Finding]]] = {}
        self.codec = default_codec()

    def side(self, stop: threading.Event) -> None:
        producer = kafka_clients.producer(self.kafka, {"linger.ms": 0})
        try:
            wait_for(self.loop.ready, stop, 120)
            caught_up = getattr(self.view, "caught_up", None)
            if caught_up is not None and not wait_for(caught_up, stop, 300):
                if stop.is_set():
                    return
                log.warning("operations: the view has not caught up in 300 s; observing anyway")
            if self.policy is not None:
                produce(
                    producer,
                    ops_output(
                        self.topics,
                        ops_event("OPS_POLICY", self.clock(), self.policy.as_data(), actor="serve"),
                        self.codec,
                    ),
                )
            self.ticking.set()
            recommended_at = float("-inf")
            while not stop.is_set():
                self.tick(producer)
                if (
                    self.recommend is not None
                    and time.monotonic() - recommended_at >= self.recommend_every_s
                ):
                    recommended_at = time.monotonic()
                    self._recommend(producer)
                stop.wait(self.tick_interval_s)
        finally:
            producer.flush(10)

    def _recommend(self, producer: Any) -> None:
        assert self.recommend is not None
        try:
            events = self.recommend(self.clock())
        except FleetlineError as exc:  # the store or the scheduler not answering this time
            log.warning("operations: no tuning this round: %s", exc)
            return
        for event in events:
            produce(producer, ops_output(self.topics, event, self.codec))
        self.recommended += len(events)

    def tick(self, producer: Any) -> None:
        full = time.monotonic() - self._read_at >= self.readings_every_s
        if full:
            seen = self.view.read(lambda view: observe(view, self.rules))
            self._read_at = time.monotonic()
            self._limits = {n: load[3] for n, load in seen.loads.items()}
            self._from_readings = [f for f in seen.findings if f.rule in READING_RULES]
        else:
            cheap = self.view.read(
                lambda view: observe(view, self.rules, False, self._limits, self._health)
            )
            # What the last full scan found in the readings stands until the next one.
            judged = {f.node_id for f in cheap.findings if f.rule == "node_silent"}
            kept = [f for f in self._from_readings if f.node_id not in judged]
            seen = Observation([*cheap.findings, *kept], cheap.loads, cheap.skipped_clusters)
        changed = {n: load for n, load in seen.loads.items() if self._sent.get(n) != load}
        found = sorted((f.node_id, f.rule, f.summary) for f in seen.findings)
        now = time.monotonic()
        if (
            not changed
            and found == self._found
            and seen.skipped_clusters == self._skipped
            and now - self._observed_at < self.quiet_every_s
        ):
            return  # nothing new: the log gets an OBSERVE only every `quiet_every_s`
        self._found, self._skipped, self._observed_at = found, seen.skipped_clusters, now
        # Many changed loads (the first observation of a large fleet) go in parts, each well
        # under a Kafka message's megabyte; only the last carries the findings and is judged.
        loads = [(n, list(load)) for n, load in sorted(changed.items())]
        parts = [loads[i : i + LOADS_PER_EVENT] for i in range(0, len(loads), LOADS_PER_EVENT)]
        now_ms = self.clock()
        for number, part in enumerate(parts or [[]], start=1):
            payload: dict[str, Any] = {"loads": dict(part)}
            if number < len(parts):
                payload["partial"] = True
            else:
                payload["findings"] = [f.as_data() for f in seen.findings]
                payload["skipped_clusters"] = seen.skipped_clusters
            event = ops_event("OBSERVE", now_ms, payload, actor="ticker")
            produce(producer, ops_output(self.topics, event, self.codec))
        producer.flush(10)
        self._sent.update(changed)
        self.ticks += 1

    def fold(self) -> OpsFold:
        """The committed state (what the API and `fleetline tickets` show)."""
        return committed(self.store)


def load_ops_policy(path: str | None) -> tuple[OpsPolicy | None, HealingRules]:
    """The operations policy and healing rules from a YAML or JSON file (None: the defaults,
    and the policy the log already holds)."""
    if path is None:
        return None, HealingRules()
    fields = dict(mapping_file(path, "operations policy"))
    rules = fields.pop("rules", None) or {}
    try:
        return OpsPolicy.from_data(fields), HealingRules.from_data(rules)
    except InvalidEventError as exc:
        raise ConfigError(f"operations policy {path}: {exc}") from None


def tickets_from_log(kafka: KafkaSettings, topics: Topics) -> dict[str, dict[str, Any]]:
    """Every ticket as it stands now, from the tickets topic (the latest change of each)."""
    codec = default_codec()
    out: dict[str, dict[str, Any]] = {}
    for msg in read_topic(kafka, topics.tickets):
        record = codec.decode(msg.value(), expect=REPAIR_TICKET).record
        current = out.get(record["ticket_id"])
        if current is None or record["seq"] > current["seq"]:
            out[record["ticket_id"]] = ticket_from_record(record)
    return out


def append(
    kafka: KafkaSettings, topics: Topics, events: Sequence[Mapping[str, Any]], producer: Any = None
) -> list[int]:
    """Append events to the operations log; their offsets once the broker has them."""
    codec = default_codec()
    producer = producer or kafka_clients.producer(kafka, {"linger.ms": 0})
    return deliver(
        producer, [ops_output(topics, e, codec) for e in events], "the operations log", 30
    )


def stored_recommendations(
    rows: Callable[[str], list[list[Any]]], jobs: Sequence[Mapping[str, Any]], days: int = 30
) -> list[tuple[Recommendation, Mapping[str, Any]]]:
    """`tuning.recommend` over `days` of stored history (`rows` runs a query): what `fleetline
    tune` prints and `recommendation_events` appends."""
    from fleetline.storage.queries import (
        checkpoint_costs_sql,
        failure_history_sql,
        memory_by_job_sql,
    )

    return recommend(
        rows(failure_history_sql(days)),
        rows(checkpoint_costs_sql(days)),
        rows(memory_by_job_sql(days)),
        jobs,
    )


def recommendation_events(
    rows: Callable[[str], list[list[Any]]],
    jobs: Sequence[Mapping[str, Any]],
    ts: int,
    actor: str,
    days: int = 30,
) -> list[OpsEvent]:
    """RECOMMENDATION events for the running training jobs, from `days` of stored history
    (`rows` runs a query), as `actor` made them."""
    return [
        ops_event(
            "RECOMMENDATION",
            ts,
            {**rec.as_data(), "document": dict(document)},
            key=rec.job,
            actor=actor,
        )
        for rec, document in stored_recommendations(rows, jobs, days)
    ]


class KafkaOperations:
    """What the API needs of operations: tickets (from the running service, else the log) and
    appending ticket moves."""

    def __init__(self, kafka: KafkaSettings, topics: Topics, service: OpsService | None) -> None:
        self.kafka, self.topics, self.service = kafka, topics, service
        self._producer = kafka_clients.producer(kafka, {"linger.ms": 0})
        self._lock = threading.Lock()

    def tickets(self) -> list[dict[str, Any]]:
        if self.service is not None:
            fold = self.service.fold()
            found = [t.as_data() for t in fold.tickets.values()]
        else:
            found = list(tickets_from_log(self.kafka, self.topics).values())
        return sorted(found, key=lambda t: (t["opened_ms"], t["ticket_id"]))

    def ticket(self, ticket_id: str) -> dict[str, Any] | None:
        return next((t for t in self.tickets() if t["ticket_id"] == ticket_id), None)

    def append(self, events: Sequence[Mapping[str, Any]]) -> list[int]:
        """Append events (recommendations, capacity requests) to the operations log."""
        with self._lock:
            return append(self.kafka, self.topics, events, self._producer)

    def move(self, ticket_id: str, state: str, note: str, actor: str, ts: int) -> int:
        ticket = self.ticket(ticket_id)
        if ticket is None:
            raise FleetlineError(f"no ticket {ticket_id!r}")
        check_move(ticket_id, ticket["state"], state)
        event = ops_event(
            "TICKET_UPDATE", ts, {"state": state, "note": note}, key=ticket_id, actor=actor
        )
        with self._lock:
            return append(self.kafka, self.topics, [event], self._producer)[0]
