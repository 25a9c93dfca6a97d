"""The imperative shell around the scheduler: the request log in, decisions and allocations out,
exactly once; a ticker that observes the resource view; requests from the CLI and the API.

The scheduler runs in the stream loop (`streams/loop.py`), exactly once, over its
single-partition request topic. Its state lives in a store backed by a compacted changelog,
written in the same transaction as its outputs and the consumed offset, so a crash or an abort
neither repeats nor loses a decision. After a restore (checked against the group's committed
offset) or an abort the step rebuilds the scheduler from the committed store (and the view at
the offsets the state last observed), and at no other time (`FoldStep`).

The ticker reads the live view every `tick_interval_s`, keeps what it observed under the view's
offsets and appends a TICK naming them; when the TICK comes round in the log, the handler uses
that observation (or, after a restart, rebuilds the view at those offsets from snapshots and
the log). A replay does the same (`processors/decision_replay.replay_decisions`), which is why it
reproduces every decision byte for byte.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import Message

from fleetline.config import KafkaSettings
from fleetline.errors import StreamError
from fleetline.identity.writers import EstablishesWriters
from fleetline.observability import metrics, tracing
from fleetline.processors.scheduling.capacity import FleetFacts, observe, observe_summaries
from fleetline.processors.scheduling.client import (
    APPLICATION_ID,
    changelog,
    decisions_of,
    job_records,
    read_state,
    send,
    state_store,
    submit,
    wait_for_decisions,
)
from fleetline.processors.scheduling.codec import (
    canonical_json,
    effect_record,
    new_request,
    offsets_of,
)
from fleetline.processors.scheduling.effects import Decision, Effect, WorkloadOrder
from fleetline.processors.scheduling.policy import SchedulingPolicy
from fleetline.processors.scheduling.scheduler import Scheduler
from fleetline.processors.view.model import ResourceView
from fleetline.processors.view.read import ViewSource
from fleetline.processors.view.runtime import SummaryFollower
from fleetline.streams import kafka as kafka_clients
from fleetline.streams.events import (
    ALLOCATION,
    DATASET_PREWARM,
    DATASET_STATE,
    SCHEDULER_REQUEST,
    SCHEDULING_DECISION,
    WORKLOAD_ORDER,
)
from fleetline.streams.loop import (
    FoldService,
    FoldStep,
    StepResult,
    fold_loop,
    wait_for,
)
from fleetline.streams.records import Offsets, Output, where
from fleetline.streams.serde import AvroCodec, default_codec
from fleetline.streams.store import ChangelogStore
from fleetline.streams.topics import Topics, TopicSpec
from fleetline.streams.writers import WriterGate

log = logging.getLogger(__name__)


def scheduler_topics(topics: Topics) -> list[TopicSpec]:
    """Every topic the scheduler reads or writes, for `ensure_topics`."""
    return [*topics.specs(), changelog(topics)]


def _offsets_key(offsets: Mapping[str, Mapping[int, int]]) -> str:
    return canonical_json(
        {t: {str(p): o for p, o in sorted(ps.items())} for t, ps in sorted(offsets.items())}
    )


@dataclass
class Observations:
    """What the ticker saw of the view, by the offsets it stood at, until its TICK is folded."""

    keep: int = 32
    _seen: dict[str, FleetFacts] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def put(self, facts: FleetFacts) -> None:
        with self._lock:
            self._seen[_offsets_key(facts.offsets)] = facts
            while len(self._seen) > self.keep:
                self._seen.pop(next(iter(self._seen)))

    def get(self, offsets: Mapping[str, Mapping[int, int]]) -> FleetFacts | None:
        with self._lock:
            return self._seen.get(_offsets_key(offsets))


class SchedulerStep(FoldStep[Scheduler]):
    """Folds one request into the scheduler; its effects become the transaction's outputs and
    its changed state the store's changelog records, in the same transaction."""

    def __init__(
        self,
        topics: Topics,
        store: ChangelogStore[Any],
        facts_at: Callable[[Offsets], FleetFacts],
        observations: Observations,
        gate: EstablishesWriters,
        codec: AvroCodec | None = None,
    ) -> None:
        super().__init__()
        self.gate = gate
        self.topics = topics
        self.state = store  # the scheduler's state as changelog records
        self.stores = [store]
        self.facts_at = facts_at
        self.observations = observations
        self.codec = codec or default_codec()
        self.decisions = 0

    @property
    def scheduler(self) -> Scheduler | None:
        """The live scheduler (None until the first request after a restore)."""
        return self._fold

    def restore_fold(self) -> Scheduler:
        records = {key.decode(): value for key, value in self.state.items([0])}
        if not records:
            # The default policy: a configured one reaches the state only through a POLICY
            # request in the log, so a replay, which folds the same log, uses it from there too.
            return Scheduler()
        return Scheduler.from_records(records, self._facts(Scheduler.view_offsets_of(records)))

    def facts_for(self, offsets: Offsets) -> FleetFacts:
        """The view as a TICK at `offsets` observed it (what the restored state was decided on)."""
        return self._facts(offsets)

    def _facts(self, offsets: Offsets) -> FleetFacts:
        seen = self.observations.get(offsets)
        if seen is not None:
            return seen
        return self.facts_at(offsets) if offsets else observe(ResourceView())

    def process(self, messages: list[Message]) -> StepResult[None]:
        self.gate.new_batch(messages)
        return super().process(messages)

    def handle(self, message: Message) -> Sequence[Output]:
        _, _, offset = where(message)
        writer = self.gate.writer_of(message)
        with self.lock:
            scheduler = self.fold()
            request = self.codec.decode(message.value(), expect=SCHEDULER_REQUEST).record
            facts = None
            if request["kind"] == "TICK":
                facts = self._facts(offsets_of(request))
            try:
                effects = scheduler.step(request, offset, facts, writer)
            finally:
                for key, value in scheduler.drain_dirty():
                    self.state.put(0, key.encode(), value)
            outputs = self._outputs(effects)
            if any(isinstance(e, Decision) for e in effects):
                appended_ms = message.timestamp()[1]
                if appended_ms > 0:
                    metrics.DECISION_LATENCY.observe(max(0.0, time.time() - appended_ms / 1000))
            return outputs

    def _trace(self, effect: Effect) -> tracing.TraceContext | None:
        """The trace an effect belongs to: its job's (the submitting request's), with a span id
        derived from the effect, so a replay stamps the same header."""
        if isinstance(effect, WorkloadOrder):
            trace_id: str | None = effect.trace_id
            seed = f"order/{effect.job}/{effect.epoch}/{effect.attempt}/{effect.action}"
        else:
            job_key = getattr(effect, "job", None)
            job = self._fold.jobs.get(job_key) if self._fold and job_key else None
            trace_id = job.trace_id if job is not None else None
            seed = (
                f"decision/{effect.decision_id}"
                if isinstance(effect, Decision)
                else f"{type(effect).__name__}/{job_key}/{getattr(effect, 'seq', '')}"
            )
        return tracing.of_trace(trace_id, seed) if trace_id else None

    def _outputs(self, effects: Sequence[Effect]) -> list[Output]:
        topics = {
            SCHEDULING_DECISION: self.topics.decisions,
            ALLOCATION: self.topics.allocations,
            DATASET_PREWARM: self.topics.prewarms,
            DATASET_STATE: self.topics.datasets,
            WORKLOAD_ORDER: self.topics.orders,
        }
        out = []
        for effect in effects:
            name, key, record = effect_record(effect)
            topic = topics[name]
            if isinstance(effect, Decision):
                self.decisions += 1
                metrics.DECISIONS.labels(effect.outcome.value).inc()
            headers = tracing.header(self._trace(effect))
            out.append(
                Output(
                    topic, key.encode(), self.codec.encode(name, record), headers=headers or None
                )
            )
        return out


@dataclass
class SchedulerService(FoldService):
    """The scheduler's processor loop plus its ticker, run together by `run(stop)`."""

    side_name = "scheduler-tick"

    kafka: KafkaSettings
    topics: Topics
    view: ViewSource
    facts_at: Callable[[Offsets], FleetFacts]
    policy: SchedulingPolicy | None = None
    tick_interval_s: float = 1.0
    instance_id: str = "0"
    batch_size: int = 500
    # A short poll: a batch is whatever arrived during the last transaction's commit, so a
    # request waits for one commit, not for a poll timeout as well.
    poll_timeout_s: float = 0.005
    clock: Callable[[], int] = field(default=lambda: int(time.time() * 1000))
    # Set once the ticker has started (the loop has its partition, the view has caught up).
    ticking: threading.Event = field(default_factory=threading.Event)
    # Observe the view shards' capacity summaries, not `view` (a sharded deployment, where no
    # process folds every shard): each TICK then names the summaries topic's offset.
    sharded: bool = False

    def __post_init__(self) -> None:
        self.store = state_store(self.topics)
        self.observations = Observations()
        self.step = SchedulerStep(
            self.topics,
            self.store,
            self.facts_at,
            self.observations,
            WriterGate(self.kafka, self.topics),
        )
        self.loop = fold_loop(
            self.kafka,
            self.topics,
            APPLICATION_ID,
            self.topics.scheduler_requests,
            self.step,
            self.instance_id,
            max_messages=self.batch_size,
            max_wait_s=self.poll_timeout_s,
        )
        self.name = self.loop.name
        self.ready = self.loop.ready
        self.ticks = 0
        self._last_facts: FleetFacts | None = None
        self._summaries: SummaryFollower | None = None

    def side(self, stop: threading.Event) -> None:
        producer = kafka_clients.producer(self.kafka, {"linger.ms": 0})
        try:
            if not wait_for(self.loop.ready, stop, 120):
                if stop.is_set():
                    return
                log.warning("scheduler: no partition assigned in 120 s; ticking anyway")
            if self.sharded:
                self._summaries = SummaryFollower(self.kafka, self.topics)
                self._summaries.to_end(300)
            else:
                # Observing a view still restoring its snapshots would make the fleet look
                # smaller than it is; the first tick waits for the view to catch up.
                caught_up = getattr(self.view, "caught_up", None)
                if caught_up is not None and not wait_for(caught_up, stop, 300):
                    if stop.is_set():
                        return
                    log.warning("scheduler: the view has not caught up in 300 s; ticking anyway")
            self._send_policy(producer)
            self.ticking.set()
            while not stop.is_set():
                self.tick(producer)
                stop.wait(self.tick_interval_s)
        finally:
            producer.flush(10)
            if self._summaries is not None:
                self._summaries.close()

    def _send_policy(self, producer: Any) -> None:
        if self.policy is None:
            return
        deadline = time.monotonic() + 30
        while self.step.scheduler is None and time.monotonic() < deadline:
            # The handler restores its state with the first request; wait for one tick's worth.
            self.tick(producer)
            time.sleep(0.2)
        current = self.step.scheduler
        if current is not None and current.digest == self.policy.digest():
            return
        send(
            producer,
            self.topics,
            new_request(
                "POLICY",
                "",
                "",
                self.clock(),
                uuid.uuid4().hex,
                actor="scheduler",
                spec_json=canonical_json(self.policy.as_data()),
            ),
        )

    def observe_now(self) -> FleetFacts:
        """What the next TICK names: the view now, or the summaries read so far."""
        last = self._last_facts
        if self._summaries is not None:
            self._summaries.poll()
            return observe_summaries(self._summaries.records, self._summaries.offsets, last)
        return self.view.read(lambda view: observe(view, last))

    def tick(self, producer: Any) -> None:
        facts = self.observe_now()
        self._last_facts = facts
        self.observations.put(facts)
        send(
            producer,
            self.topics,
            new_request("TICK", "", "", self.clock(), uuid.uuid4().hex, view_offsets=facts.offsets),
        )
        producer.flush(10)
        self.ticks += 1

    def jobs(self, tenant: str | None = None) -> list[dict[str, Any]]:
        """The committed job records (what `fleetline get` shows), for the caller's tenant."""
        return job_records(self.store, tenant)


class KafkaJobs:
    """What the API needs of the scheduler: append requests to its log, read its committed
    state (from the running service's store, or restored from the changelog), read decisions."""

    def __init__(
        self,
        kafka: KafkaSettings,
        topics: Topics,
        service: SchedulerService | None = None,
        facts_at: Callable[[Offsets], FleetFacts] | None = None,
    ) -> None:
        self.kafka = kafka
        self.topics = topics
        self.service = service
        # The view at a TICK's offsets, where no scheduler runs in this process.
        self.facts_at = facts_at
        self._producer = kafka_clients.producer(kafka, {"linger.ms": 0})
        self._lock = threading.Lock()

    def submit(self, requests: Sequence[Mapping[str, Any]]) -> list[int]:
        with self._lock:
            return submit(self.kafka, self.topics, requests, producer=self._producer)

    def _store(self) -> ChangelogStore[Any]:
        return (
            self.service.store if self.service is not None else read_state(self.kafka, self.topics)
        )

    def jobs(self, tenant: str | None = None) -> list[dict[str, Any]]:
        return job_records(self._store(), tenant)

    def job(self, key: str) -> dict[str, Any] | None:
        return self._store().committed(0, f"job:{key}".encode())

    def decisions(self, job: str) -> list[dict[str, Any]]:
        return decisions_of(self.kafka, self.topics, job)

    def fits(self, tenant: str | None = None) -> list[dict[str, Any]]:
        """What would make each queued job (of `tenant`) fit: postmortem/fit.py, asked of the
        committed state."""
        from fleetline.processors.postmortem.queue import committed_fits

        records = {key.decode(): value for key, value in self._store().items([0])}
        facts_at = self.service.step.facts_for if self.service is not None else self.facts_at
        if facts_at is None:
            raise StreamError("no view to place the queue against in this process")
        return [
            f.as_data()
            for f in committed_fits(records, facts_at)
            if tenant is None or f.tenant == tenant
        ]

    def wait(
        self, keys: list[str], offsets: list[int], timeout_s: float
    ) -> dict[str, dict[str, Any]]:
        return wait_for_decisions(self.kafka, self.topics, keys, offsets, timeout_s)
