"""Re-making what the scheduler and the operations fold decided, from their logs, and comparing
it with what they published: every decision and ticket change byte for byte, the scheduler's
committed state record by record, and what each dead-lettered (`fleetline replay --decisions`,
`--operations`)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fleetline.config import KafkaSettings
from fleetline.errors import ConfigError, DecodeError, FleetlineError, StreamError
from fleetline.identity.writers import Writer
from fleetline.processors.operations.fold import Command, OpsFold, TicketChanged
from fleetline.processors.operations.runtime import APPLICATION_ID as OPS_APP
from fleetline.processors.operations.runtime import command_record, ticket_record
from fleetline.processors.postmortem.whatif import Change, WhatIf, logged_runs
from fleetline.processors.scheduling.capacity import FleetFacts
from fleetline.processors.scheduling.client import APPLICATION_ID as SCHEDULER_APP
from fleetline.processors.scheduling.client import read_state, read_topic
from fleetline.processors.scheduling.codec import canonical_json, effect_record, offsets_of
from fleetline.processors.scheduling.effects import Decision
from fleetline.processors.scheduling.policy import SchedulingPolicy
from fleetline.processors.scheduling.scheduler import Scheduler
from fleetline.streams import kafka as kafka_clients
from fleetline.streams.deadletter import read_dead_letter
from fleetline.streams.events import NODE_COMMAND, OPS_EVENT, REPAIR_TICKET, SCHEDULER_REQUEST
from fleetline.streams.records import Offsets, where
from fleetline.streams.serde import AvroCodec, default_codec
from fleetline.streams.topics import Topics
from fleetline.streams.writers import replay_gate


@dataclass
class DecisionReplay:
    requests: int = 0
    ticks: int = 0
    decisions: int = 0
    matched: int = 0
    first_difference: str | None = None
    view_rebuilds: int = 0
    # Requests past the scheduler's committed offset: not yet decided live, so not replayed.
    unprocessed: int = 0
    # Requests the replay passed over (request offset -> why), as the live scheduler must have.
    dead_letters: dict[int, str] = field(default_factory=dict)
    seconds: float = 0.0
    scheduler: Scheduler | None = None
    # The live scheduler's committed state (its changelog) against the replayed one: "equal",
    # "differs" (`state_difference` says where) or "not compared" (why, in `state_difference`).
    state: str = "not compared"
    state_records: int = 0
    state_difference: str | None = None

    @property
    def ok(self) -> bool:
        return self.first_difference is None and self.state != "differs"


def replay_decisions(
    kafka: KafkaSettings,
    topics: Topics,
    facts_at: Callable[[Offsets, FleetFacts | None], FleetFacts],
    policy: SchedulingPolicy | None = None,
    codec: AvroCodec | None = None,
    compare_state: bool = True,
) -> DecisionReplay:
    """Fold the request log again, observing what each TICK names (the view at its offsets, or
    the shards' summaries: `ViewFollower.facts`), and compare each decision with the one the
    log holds, byte for byte; with `compare_state`, then the replayed scheduler's state with
    the live one's committed state, record by record.

    The log is folded as far as the scheduler has committed (its decisions and its consumed
    offset go in one transaction): requests appended after it stopped have no decisions yet,
    and a replay that made them would report a difference that is not one."""
    began = time.perf_counter()
    codec = codec or default_codec()
    recorded = iter(read_topic(kafka, topics.decisions))
    result = DecisionReplay()
    scheduler = Scheduler(policy)
    last: FleetFacts | None = None
    committed = kafka_clients.committed_offsets(
        kafka, f"{topics.prefix}.{SCHEDULER_APP}", topics.scheduler_requests
    ).get(0)
    # Who wrote each request is established as the live scheduler did: the same MACs, and the
    # identities topic read whole, so a revoked writer's later requests are refused here too.
    gate = replay_gate(kafka, topics)
    for msg in read_topic(kafka, topics.scheduler_requests):
        if committed is not None and where(msg)[2] >= committed:
            result.unprocessed += 1
            continue
        result.requests += 1
        try:
            writer = gate.writer_of(msg)
            request = codec.decode(msg.value(), expect=SCHEDULER_REQUEST).record
            facts = None
            if request["kind"] == "TICK":
                result.ticks += 1
                facts = last = facts_at(offsets_of(request), last)
            effects = scheduler.step(request, where(msg)[2], facts, writer)
        except StreamError:
            raise  # the replay's own reading failed: nothing the live scheduler met
        except FleetlineError as exc:
            # The live loop dead-letters every FleetlineError of a message, with this reason.
            result.dead_letters[where(msg)[2]] = str(exc)
            continue
        for effect in effects:
            if not isinstance(effect, Decision):
                continue
            name, key, record = effect_record(effect)
            again = codec.encode(name, record)
            result.decisions += 1
            live = next(recorded, None)
            if live is None:
                result.first_difference = (
                    f"decision {effect.decision_id} for {effect.job} is not in the log"
                )
                break
            if live.value() != again or live.key() != key.encode():
                was = codec.decode(live.value()).record
                mine = codec.decode(again).record
                fields = sorted(f for f in mine if mine[f] != was.get(f))
                result.first_difference = (
                    f"decision {effect.decision_id} for {effect.job}: replayed "
                    f"{record['outcome']} ({record['reason'][:120]}), the log has "
                    f"{was['decision_id']} {was['outcome']} ({was['reason'][:120]}); "
                    + "; ".join(
                        f"{f}: replayed {str(mine[f])[:300]}, logged {str(was.get(f))[:300]}"
                        for f in fields
                    )
                )
                break
            result.matched += 1
        if result.first_difference:
            break
    else:
        # The decision log is read to its end as it stands when the comparison reaches it,
        # after `committed` was read: a live scheduler may have decided later requests by then.
        # Their decisions are not differences (the replay stopped where the scheduler had
        # committed); a decision of a request before that point that the replay did not make is.
        extra = next(
            (
                was
                for was in (codec.decode(m.value()).record for m in recorded)
                if committed is None or was["input_offset"] < committed
            ),
            None,
        )
        if extra is not None:
            result.first_difference = (
                f"the log has decision {extra['decision_id']} (of request "
                f"{extra['input_offset']}) that the replay did not make"
            )
        else:
            result.first_difference = same_dead_letters(
                live_dead_letters(
                    kafka, topics, f"{topics.prefix}.{SCHEDULER_APP}", topics.scheduler_requests
                ),
                result.dead_letters,
                committed,
                "request",
            )
    result.scheduler = scheduler
    if compare_state and result.first_difference is None:
        _compare_state(kafka, topics, scheduler, committed, result)
    result.seconds = time.perf_counter() - began
    return result


def live_dead_letters(
    kafka: KafkaSettings, topics: Topics, application: str, source: str
) -> dict[int, str]:
    """What a live processor dead-lettered from a single-partition input: offset -> reason (a
    message dead-lettered twice, across a crash, has one source and one entry)."""
    out: dict[int, str] = {}
    partitions = kafka_clients.partitions_of(kafka, topics.dead_letter)
    group = f"fleetline-replay-{uuid.uuid4().hex[:12]}"
    for msg in kafka_clients.read_to_end(kafka, topics.dead_letter, partitions, group):
        letter = read_dead_letter(msg)
        if letter.application == application and letter.topic == source:
            out[letter.offset] = letter.reason
    return out


def same_dead_letters(
    live: dict[int, str], replayed: dict[int, str], below: int | None, what: str
) -> str | None:
    """The first message the replay passed over otherwise than the live processor (only below
    `below`, where the live one had got to), or None."""
    live = {o: r for o, r in live.items() if below is None or o < below}
    for offset in sorted(set(live) | set(replayed)):
        if live.get(offset) != replayed.get(offset):
            return (
                f"{what} at offset {offset}: dead-lettered live "
                + (f"({live[offset][:200]})" if offset in live else "? no")
                + ", by the replay "
                + (f"({replayed[offset][:200]})" if offset in replayed else "? no")
            )
    return None


def _compare_state(
    kafka: KafkaSettings,
    topics: Topics,
    replayed: Scheduler,
    committed: int | None,
    result: DecisionReplay,
) -> None:
    """The live scheduler's changelog against the replayed state, where the changelog stands at
    the offset the replay folded to (a scheduler still running may have moved on since)."""
    live = read_state(kafka, topics)
    stands = live.positions(0).get(topics.scheduler_requests)
    if stands != committed:
        result.state_difference = (
            f"the scheduler's changelog reflects its log up to {stands}, its group committed "
            f"{committed} when the replay began (a running scheduler moves on)"
        )
        return
    theirs = {key.decode(): canonical_json(value) for key, value in live.items([0])}
    ours = {key: canonical_json(value) for key, value in replayed.records() if value is not None}
    result.state_records = len(theirs)
    for key in sorted(set(theirs) | set(ours)):
        if theirs.get(key) != ours.get(key):
            result.state = "differs"
            result.state_difference = (
                f"record {key}: the live scheduler has "
                f"{(theirs.get(key) or 'none')[:200]}, the replay has "
                f"{(ours.get(key) or 'none')[:200]}"
            )
            return
    result.state = "equal"


@dataclass
class OperationsReplay:
    events: int = 0
    dead_letters: dict[int, str] = field(default_factory=dict)  # event offset -> why
    tickets: int = 0  # ticket changes replayed and matched, in order
    commands: int = 0  # node commands replayed and matched, by id
    first_difference: str | None = None
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.first_difference is None


def replay_operations(
    kafka: KafkaSettings, topics: Topics, codec: AvroCodec | None = None
) -> OperationsReplay:
    """Fold the whole operations log again and compare what it decides with what was
    published: every ticket change byte for byte and in order, every node command it issued
    byte for byte (the command topic's partitions have no common order, so by command id)."""
    began = time.perf_counter()
    codec = codec or default_codec()
    result = OperationsReplay()
    recorded = iter(read_topic(kafka, topics.tickets))
    commands: dict[str, bytes] = {}
    for msg in kafka_clients.read_to_end(
        kafka,
        topics.commands,
        kafka_clients.partitions_of(kafka, topics.commands),
        f"fleetline-replay-{uuid.uuid4().hex[:12]}",
    ):
        try:
            record = codec.decode(msg.value(), expect=NODE_COMMAND).record
        except DecodeError:
            continue  # not a command the operations processor wrote (node agents pass it over)
        value = msg.value()
        if record["issued_by"] == "operations" and value is not None:
            commands[record["command_id"]] = value
    fold = OpsFold()
    for msg in read_topic(kafka, topics.ops):
        result.events += 1
        try:
            effects = fold.step(codec.decode(msg.value(), expect=OPS_EVENT).record, where(msg)[2])
        except FleetlineError as exc:  # dead-lettered live with this reason
            result.dead_letters[where(msg)[2]] = str(exc)
            continue
        for effect in effects:
            if isinstance(effect, TicketChanged):
                again = codec.encode(REPAIR_TICKET, ticket_record(effect.ticket))
                live = next(recorded, None)
                if live is None or live.value() != again:
                    result.first_difference = (
                        f"ticket {effect.ticket['ticket_id']} change {effect.ticket['seq']} "
                        + ("is not in the log" if live is None else "differs from the log's")
                    )
                    break
                result.tickets += 1
            elif isinstance(effect, Command):
                again = codec.encode(NODE_COMMAND, command_record(effect))
                if commands.pop(effect.command_id, None) != again:
                    result.first_difference = f"command {effect.command_id} differs or is missing"
                    break
                result.commands += 1
        if result.first_difference:
            break
    else:
        extra = next(recorded, None)
        if extra is not None:
            result.first_difference = "the tickets topic has a change the replay did not make"
        elif commands:
            result.first_difference = f"the replay did not issue command {min(commands)}"
        else:
            application = f"{topics.prefix}.{OPS_APP}"
            result.first_difference = same_dead_letters(
                live_dead_letters(kafka, topics, application, topics.ops),
                result.dead_letters,
                kafka_clients.committed_offsets(kafka, application, topics.ops).get(0),
                "event",
            )
    result.seconds = time.perf_counter() - began
    return result


def what_if_decisions(
    kafka: KafkaSettings,
    topics: Topics,
    facts_at: Callable[[Offsets, FleetFacts | None], FleetFacts],
    change: Change,
    from_ms: int | None = None,
    to_ms: int | None = None,
    codec: AvroCodec | None = None,
) -> dict[str, Any]:
    """The request log folded as it was and with `change`, in lockstep (postmortem/whatif.py),
    as far as the scheduler has committed; the diff and the deltas over [from, to]."""
    began = time.perf_counter()
    codec = codec or default_codec()
    committed = kafka_clients.committed_offsets(
        kafka, f"{topics.prefix}.{SCHEDULER_APP}", topics.scheduler_requests
    ).get(0)
    gate = replay_gate(kafka, topics)
    logged: list[tuple[dict[str, Any], int, Writer]] = []
    refused = 0
    for msg in read_topic(kafka, topics.scheduler_requests):
        position = where(msg)[2]
        if committed is not None and position >= committed:
            break
        try:
            writer = gate.writer_of(msg)
            request = codec.decode(msg.value(), expect=SCHEDULER_REQUEST).record
        except StreamError:
            raise
        except FleetlineError:
            refused += 1  # dead-lettered live: neither fold takes it
            continue
        logged.append((request, position, writer))
    if not logged:
        raise ConfigError(f"the scheduler's request log ({topics.scheduler_requests}) is empty")
    whatif = WhatIf(change, logged_runs([r for r, _, _ in logged]), from_ms, to_ms)
    last: FleetFacts | None = None
    for request, position, writer in logged:
        facts = None
        if request["kind"] == "TICK":
            facts = last = facts_at(offsets_of(request), last)
        whatif.step(request, position, writer, facts)
    decisions = [codec.decode(m.value()).record for m in read_topic(kafka, topics.decisions)]
    report = whatif.report(
        [d for d in decisions if committed is None or d["input_offset"] < committed]
    )
    report["requests_refused"] = refused
    report["seconds"] = round(time.perf_counter() - began, 3)
    return report
