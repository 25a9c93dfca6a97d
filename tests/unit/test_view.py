"""The resource view's pure fold: health, reachability, allocations, order independence, codec,
and the columnar decode path agreeing with the per-record one."""

from __future__ import annotations

import random

import pytest
from confluent_kafka import Message

from fleetline.errors import InvalidEventError
from fleetline.processors.view import codec as view_codec
from fleetline.processors.view import read as view_read
from fleetline.processors.view.fold import apply, compose, gpu_health, node_status
from fleetline.processors.view.folder import FLEET_PART, PartFolder, shard_part
from fleetline.processors.view.model import DEGRADED, FAILED, HEALTHY, HealthPolicy, ResourceView
from tests.fleet_events import (
    CODEC,
    TOPICS,
    allocation,
    decoded,
    fold,
    messages,
    scenario_events,
    scenario_fleet,
)
from tests.support import BASE_MS


def test_rdma_loss_degrades_the_sixteen_gpus_behind_the_leaf_and_they_recover():
    events = scenario_events(seconds=20)
    view = fold(events)
    degraded = view_read.select_gpus(view, health=DEGRADED)
    rdma = sorted(f"{g['node_id']}/{g['gpu_index']}" for g in degraded if g["cause"] == "rdma_loss")
    assert len(rdma) == 16
    assert {g.split("/")[0] for g in rdma} == {"us-east-a-n0000", "us-east-a-n0001"}
    # The fault lasts 30 s from t=5; 30 clean samples later the GPUs are healthy again.
    view = fold(scenario_events(seconds=70))
    assert not [
        g for g in view_read.select_gpus(view, health=DEGRADED) if g["cause"] == "rdma_loss"
    ]
    recovered = [c for c in view.changes if c.after == HEALTHY and c.before == DEGRADED]
    assert len(recovered) >= 16


def test_nvlink_errors_degrade_and_xid_79_fails_one_gpu():
    view = fold(scenario_events(seconds=12))
    link = view.nodes["eu-west-a-n0001"]
    assert gpu_health(link, link.gpus[3]) == (DEGRADED, "nvlink_errors")
    assert all(gpu_health(link, g)[0] == HEALTHY for i, g in link.gpus.items() if i != 3)
    broken = view.nodes["eu-west-a-n0002"]
    assert gpu_health(broken, broken.gpus[5]) == (FAILED, "xid 79")
    failed_at = broken.gpus[5].failed_at_ms
    assert failed_at == BASE_MS + 8000
    capacity = {c["cluster_id"]: c for c in view_read.cluster_capacity(view)}
    assert capacity["eu-west-a"]["failed"] == 1
    assert capacity["eu-west-a"]["degraded"] == 1
    assert capacity["eu-west-a"]["idle"] == 32 - 2


def test_a_failed_gpu_stays_failed_until_its_node_comes_back_up():
    view = fold(scenario_events(seconds=12))
    node = view.nodes["eu-west-a-n0002"]
    assert gpu_health(node, node.gpus[5])[0] == FAILED
    sim = scenario_fleet()
    down = sim.node_state(sim.node("eu-west-a-n0002"), BASE_MS + 13_000, "DOWN", "reboot")
    up = sim.node_state(sim.node("eu-west-a-n0002"), BASE_MS + 14_000, "UP", "rebooted")
    down["seq"], up["seq"] = node.state_seq + 1, node.state_seq + 2
    fold([("NodeState", down)], view)
    assert gpu_health(node, node.gpus[5])[0] == FAILED
    fold([("NodeState", up)], view)
    assert gpu_health(node, node.gpus[5])[0] == HEALTHY


def test_node_down_and_unreachable_by_event_time():
    view = fold(scenario_events(seconds=11))
    assert node_status(view, view.nodes["ap-south-a-n0003"]) == "DOWN"
    # The ap-south link is cut from t=12 to t=18: its nodes go quiet while the others go on.
    view = fold(scenario_events(seconds=17))
    quiet = [n for n in view.nodes.values() if n.cluster_id == "ap-south-a"]
    assert {node_status(view, n) for n in quiet} == {"UP", "DOWN"}  # 5 s < the 10 s timeout
    policy_view = ResourceView(policy=view.policy.__class__(unreachable_after_ms=3000))
    view = fold(scenario_events(seconds=17), policy_view)
    statuses = {
        n.node_id: node_status(view, n) for n in view.nodes.values() if n.cluster_id == "ap-south-a"
    }
    assert statuses == {
        "ap-south-a-n0000": "UNREACHABLE",
        "ap-south-a-n0001": "UNREACHABLE",
        "ap-south-a-n0002": "UNREACHABLE",
        "ap-south-a-n0003": "DOWN",
    }
    capacity = {c["cluster_id"]: c for c in view_read.cluster_capacity(view)}
    assert capacity["ap-south-a"]["nodes_unreachable"] == 3
    assert capacity["ap-south-a"]["health"] == "degraded"  # one node said it is DOWN
    view = fold(scenario_events(seconds=25), ResourceView(policy=policy_view.policy))
    assert node_status(view, view.nodes["ap-south-a-n0000"]) == "UP"


def test_the_fold_does_not_depend_on_how_the_topics_were_interleaved():
    events = scenario_events(seconds=25)
    telemetry = [e for e in events if e[0] == "NodeTelemetry"]
    states = [e for e in events if e[0] == "NodeState"]
    in_order = view_codec.to_data(fold(events))
    states_last = view_codec.to_data(fold(telemetry + states))
    states_first = view_codec.to_data(fold(states + telemetry))
    rng = random.Random(3)
    # Any merge that keeps each topic's own order.
    merged, ti, si = [], 0, 0
    while ti < len(telemetry) or si < len(states):
        if si < len(states) and (ti == len(telemetry) or rng.random() < 0.1):
            merged.append(states[si])
            si += 1
        else:
            merged.append(telemetry[ti])
            ti += 1
    assert in_order == states_last == states_first == view_codec.to_data(fold(merged))


def test_repeated_events_are_no_ops():
    events = scenario_events(seconds=5)
    once = view_codec.to_data(fold(events))
    twice = view_codec.to_data(fold(events + events[len(events) // 2 :]))
    assert once == twice


def test_a_bad_event_is_refused_and_leaves_the_view_unchanged():
    sim = scenario_fleet()
    view = fold([("NodeTelemetry", r) for r in sim.telemetry(BASE_MS + 1000)])
    before = view_codec.to_data(view)
    bad = sim.telemetry(BASE_MS + 2000)[0]
    bad["gpus"][7]["gpu_util_pct"] = 140.0
    with pytest.raises(InvalidEventError, match=r"gpu_util_pct 140\.0 is outside 0-100"):
        apply(view, decoded("NodeTelemetry", bad))
    bad["gpus"][7]["gpu_util_pct"] = 50.0
    bad["gpus"][2]["gpu_index"] = 3
    with pytest.raises(InvalidEventError, match="appears twice"):
        apply(view, decoded("NodeTelemetry", bad))
    assert view_codec.to_data(view) == before
    moved = sim.telemetry(BASE_MS + 3000)[0]
    moved["cluster_id"] = "elsewhere"
    with pytest.raises(InvalidEventError, match="is in cluster"):
        apply(view, decoded("NodeTelemetry", moved))
    assert view_codec.to_data(view) == before


def test_allocations_never_double_book_a_gpu_and_show_as_tenant_usage():
    sim = scenario_fleet()
    view = fold([("NodeTelemetry", r) for r in sim.telemetry(BASE_MS + 1000)])
    node = "us-east-a-n0002"
    fold([allocation("job-a", "ALLOCATED", [(node, 0), (node, 1)], 1)], view)
    with pytest.raises(InvalidEventError, match="already allocated to job-a"):
        apply(view, decoded(*allocation("job-b", "ALLOCATED", [(node, 1), (node, 2)], 1, "t2")))
    assert "job-b" not in view.allocations
    fold([allocation("job-b", "ALLOCATED", [(node, 2)], 1, "t2")], view)
    usage = {u["tenant"]: u for u in view_read.tenant_usage(view)}
    assert usage["t1"]["gpus"] == 2 and usage["t2"]["gpus"] == 1
    capacity = {c["cluster_id"]: c for c in view_read.cluster_capacity(view)}
    assert capacity["us-east-a"]["allocated"] == 3
    fold([allocation("job-a", "RELEASED", [], 2)], view)
    assert "job-a" not in view.allocations and (node, 0) not in view.gpu_owner
    with pytest.raises(InvalidEventError, match="released but never allocated"):
        apply(view, decoded(*allocation("job-z", "RELEASED", [], 1)))


def test_cluster_facts_and_datasets_fold_and_are_validated():
    cluster = {
        "cluster_id": "us-east-a",
        "region": "us-east",
        "seq": 1,
        "ts": BASE_MS,
        "kind": "ON_PREMISES",
        "price_per_gpu_hour": 2.1,
        "energy_price_per_kwh": 0.12,
        "pue": 1.2,
        "link_latency_ms": {"eu-west": 80.0},
        "retired": False,
    }
    view = fold([("ClusterInfo", cluster)])
    assert view.clusters["us-east-a"].pue == 1.2
    with pytest.raises(InvalidEventError, match=r"pue 0\.9 is below 1"):
        apply(view, decoded("ClusterInfo", {**cluster, "seq": 2, "pue": 0.9}))
    dataset = {
        "dataset_id": "ds1",
        "tenant": "t1",
        "seq": 1,
        "ts": BASE_MS,
        "size_bytes": 10**12,
        "replicas": ["us-east-a", "us-east-a"],
        "deleted": False,
    }
    fold([("DatasetState", dataset)], view)
    assert view.datasets["ds1"].replicas == ["us-east-a"]
    fold([("DatasetState", {**dataset, "seq": 2, "deleted": True})], view)
    assert "ds1" not in view.datasets


def test_snapshot_codec_round_trips_exactly():
    events = scenario_events(seconds=15)
    view = fold([*events, allocation("job-a", "ALLOCATED", [("us-east-a-n0002", 4)], 1)])
    view.advance("x", 0, 41)
    blob, sha = view_codec.encode(view)
    again = view_codec.decode(blob, sha)
    assert view_codec.to_data(again) == view_codec.to_data(view)
    assert again.gpu_owner == view.gpu_owner
    # ... and folds on identically.
    more = scenario_events(seconds=20)[len(events) :]
    assert view_codec.to_data(fold(more, again)) == view_codec.to_data(fold(more, view))


def test_columnar_and_per_record_paths_fold_the_same_view():
    msgs = messages(scenario_events(seconds=20))
    folder = PartFolder(TOPICS)
    fast: dict[str, ResourceView] = {}
    assert folder.fold(fast, msgs) == []
    slow: dict[str, ResourceView] = {}
    for msg in msgs:  # one at a time: the batch decoder is used for runs of one
        folder.fold_one(
            slow.setdefault(folder.part_of(msg.topic(), msg.partition()), folder.new_part()),
            msg,
            [],
        )
    assert set(fast) == {shard_part(p) for p in range(3)}
    for name in fast:
        assert view_codec.to_data(fast[name]) == view_codec.to_data(slow[name])
    whole = compose(fast.values())
    assert (
        view_codec.to_data(whole)["nodes"]
        == view_codec.to_data(fold(scenario_events(seconds=20)))["nodes"]
    )


def _disturbed_telemetry(seed: int) -> list[tuple[str, dict]]:
    """The scenario's events with telemetry disturbed at random: error events, counters that
    move, RDMA loss, a swapped GPU, fewer GPUs, resent and stale records, and records the fold
    refuses (a GPU index twice, another cluster)."""
    rng = random.Random(seed)
    out: list[tuple[str, dict]] = []
    for name, record in scenario_events(seconds=40):
        if name != "NodeTelemetry" or rng.random() < 0.6:
            out.append((name, record))
            continue
        record = {**record, "gpus": [dict(g) for g in record["gpus"]]}
        gpu = rng.choice(record["gpus"])
        match rng.randrange(9):
            case 0:
                gpu["xid_codes"] = [rng.choice([79, 74, 63, 13])]
            case 1:
                gpu["ecc_dbe_total"] += 1
            case 2:
                gpu["nvlink_errors_total"] = (gpu["nvlink_errors_total"] or 0) + rng.choice([1, 5])
            case 3:
                gpu["rdma_packet_loss_ratio"] = rng.choice([0.5, 1e-5])
            case 4:
                gpu["gpu_uuid"] = f"GPU-swapped-{rng.randrange(3)}"
            case 5:
                record["gpus"] = record["gpus"][:-1]
            case 6:
                out.append((name, record))  # resent: the second is a no-op
            case 7:
                record["seq"] -= 2  # stale
            case _:
                if rng.random() < 0.5:
                    record["gpus"][1]["gpu_index"] = record["gpus"][0]["gpu_index"]
                else:
                    record["cluster_id"] = "elsewhere"
        out.append((name, record))
    return out


@pytest.mark.parametrize("seed", range(6))
def test_repeats_folded_without_their_readings_leave_the_view_record_by_record_leaves(seed):
    policy = HealthPolicy(recover_after_samples=3)
    msgs = messages(_disturbed_telemetry(seed))
    rng = random.Random(seed)
    folder = PartFolder(TOPICS, policy)
    fast: dict[str, ResourceView] = {}
    failed_fast = []
    at = 0
    while at < len(msgs):  # batches of every size, as a consumer hands them over
        size = rng.choice([1, 7, 50, 400])
        failed_fast += folder.fold(fast, msgs[at : at + size])
        at += size
    slow: dict[str, ResourceView] = {}
    failed_slow: list = []
    for msg in msgs:
        part = slow.setdefault(folder.part_of(msg.topic(), msg.partition()), folder.new_part())
        folder.fold_one(part, msg, failed_slow)
    assert sorted((m.partition(), m.offset(), str(e)) for m, e in failed_fast) == sorted(
        (m.partition(), m.offset(), str(e)) for m, e in failed_slow
    )
    assert failed_slow  # the refused records were refused
    for name in slow:
        assert view_codec.to_data(fast[name]) == view_codec.to_data(slow[name])
        # The same transitions (a batch folds its topics' runs one after another).
        assert sorted(map(repr, fast[name].changes)) == sorted(map(repr, slow[name].changes))
    assert any(c.after == HEALTHY for v in slow.values() for c in v.changes)  # recoveries


class OneByOne(PartFolder):
    """Counts the messages folded record by record."""

    one_by_one = 0

    def fold_one(self, view, msg, failed) -> None:
        self.one_by_one += 1
        super().fold_one(view, msg, failed)


def test_a_run_mixing_writer_versions_folds_as_record_by_record_does():
    msgs = [m for m in messages(scenario_events(seconds=6)) if m.topic() == TOPICS.telemetry]
    mixed = []
    for i, m in enumerate(msgs):
        if i % 2:  # every other one as an older agent writes it
            record = CODEC.decode(m.value()).record
            m = Message(
                topic=m.topic(),
                partition=m.partition(),
                offset=m.offset(),
                key=m.key(),
                value=CODEC.encode("NodeTelemetry", record, version=1),
            )
        mixed.append(m)
    folder = OneByOne(TOPICS)
    fast: dict[str, ResourceView] = {}
    assert folder.fold(fast, mixed) == [] and folder.one_by_one == 0
    slow: dict[str, ResourceView] = {}
    for msg in mixed:
        PartFolder(TOPICS).fold_one(
            slow.setdefault(folder.part_of(msg.topic(), msg.partition()), folder.new_part()),
            msg,
            [],
        )
    for name in fast:
        assert view_codec.to_data(fast[name]) == view_codec.to_data(slow[name])


def test_bad_messages_in_a_telemetry_run_are_named_and_the_rest_folded():
    msgs = messages(scenario_events(seconds=3))
    tele = [m for m in msgs if m.topic() == TOPICS.telemetry and m.partition() == 0]
    victim = tele[len(tele) // 2]
    corrupt = Message(
        topic=victim.topic(),
        partition=0,
        offset=victim.offset(),
        key=victim.key(),
        value=victim.value() + b"\x00",
    )
    wrong_key = Message(
        topic=victim.topic(),
        partition=0,
        offset=tele[1].offset(),
        key=b"someone-else",
        value=tele[1].value(),
    )
    batch = [corrupt if m is victim else wrong_key if m is tele[1] else m for m in tele]
    parts: dict[str, ResourceView] = {}
    folder = OneByOne(TOPICS)
    failed = folder.fold(parts, batch)
    assert sorted(m.offset() for m, _ in failed) == sorted([victim.offset(), tele[1].offset()])
    assert folder.one_by_one == 2  # only the bad two left the batch path
    reasons = " | ".join(str(e) for _, e in failed)
    assert "bytes left after the record" in reasons and "is not the record's node_id" in reasons
    view = parts[shard_part(0)]
    assert view.offsets[TOPICS.telemetry][0] == tele[-1].offset() + 1
    assert view.node_events == len(tele) - 2


def test_fleet_topics_fold_into_the_fleet_part_and_tombstones_remove():
    cluster = {
        "cluster_id": "c9",
        "region": "r",
        "seq": 1,
        "ts": BASE_MS,
        "kind": "CLOUD",
        "price_per_gpu_hour": None,
        "energy_price_per_kwh": None,
        "pue": None,
        "link_latency_ms": {},
        "retired": False,
    }
    msgs = [
        Message(
            topic=TOPICS.clusters,
            partition=0,
            offset=0,
            key=b"c9",
            value=CODEC.encode("ClusterInfo", cluster),
        ),
        Message(topic=TOPICS.clusters, partition=0, offset=1, key=b"c9", value=None),
    ]
    parts: dict[str, ResourceView] = {}
    assert PartFolder(TOPICS).fold(parts, msgs[:1]) == []
    assert "c9" in parts[FLEET_PART].clusters
    PartFolder(TOPICS).fold(parts, msgs[1:])
    assert "c9" not in parts[FLEET_PART].clusters
    assert parts[FLEET_PART].offsets[TOPICS.clusters][0] == 2


def test_an_agent_clock_running_ahead_does_not_make_the_others_unreachable():
    # Every record appended by the broker at its own second; one node's agent stamps its
    # events ten minutes ahead. The node topics carry LogAppendTime.
    events = scenario_events(seconds=12)
    ahead = next(r["node_id"] for name, r in events if name == "NodeTelemetry")
    skewed = [
        (name, {**r, "ts": r["ts"] + 600_000} if r["node_id"] == ahead else r) for name, r in events
    ]

    def stamped(kind: int) -> list[Message]:
        return [
            Message(
                topic=m.topic(),
                partition=m.partition(),
                offset=m.offset(),
                key=m.key(),
                value=m.value(),
                timestamp=(
                    kind,
                    record["ts"] if record["node_id"] != ahead else record["ts"] - 600_000,
                ),
            )
            for m, (_, record) in zip(messages(skewed), skewed, strict=True)
        ]

    def statuses(parts: dict[str, ResourceView]) -> set[str]:
        view = compose(parts.values())
        return {node_status(view, n) for n in view.nodes.values()}

    held: dict[str, ResourceView] = {}
    assert PartFolder(TOPICS).fold(held, stamped(2)) == []  # LogAppendTime
    view = compose(held.values())
    last_append = BASE_MS + 12_000
    assert view.watermark_ms <= last_append + 5_000
    assert view.nodes[ahead].telemetry_ts <= last_append + 5_000
    assert "UNREACHABLE" not in statuses(held)
    # A producer's CreateTime says nothing about the broker's clock: nothing is held back,
    # and the clock that runs ahead makes every other node look unreachable.
    free: dict[str, ResourceView] = {}
    assert PartFolder(TOPICS).fold(free, stamped(1)) == []
    assert compose(free.values()).watermark_ms == last_append + 600_000
    assert "UNREACHABLE" in statuses(free)


def test_a_sample_breaking_a_rule_in_a_batch_is_named_and_the_rest_folded():
    msgs = [m for m in messages(scenario_events(seconds=6)) if m.topic() == TOPICS.telemetry]
    record = CODEC.decode(msgs[3].value()).record
    record["gpus"][2]["gpu_util_pct"] = float("nan")
    bad = Message(
        topic=msgs[3].topic(),
        partition=msgs[3].partition(),
        offset=msgs[3].offset(),
        key=msgs[3].key(),
        value=CODEC.encode("NodeTelemetry", record),
    )
    batch = [*msgs[:3], bad, *msgs[4:]]
    folder = OneByOne(TOPICS)
    parts: dict[str, ResourceView] = {}
    failed = folder.fold(parts, batch)
    # The batch decoder vouched for every record but that one, which the per-record path named.
    assert folder.one_by_one == 1
    assert [(m.offset(), str(e)) for m, e in failed] == [
        (bad.offset(), f"{record['node_id']} seq {record['seq']} gpu 2: gpu_util_pct nan is "
         "outside 0-100")
    ]  # fmt: skip
    folded = sum(p.node_events for p in parts.values())
    assert folded == len(batch) - 1
