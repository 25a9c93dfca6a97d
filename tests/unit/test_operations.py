"""Automated operations' pure cores: the ticket and power-cap fold, the healing rules over a
view, the scheduler's fences, energy term and deferrable jobs, and the demand forecast."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime
from typing import Any

import pytest

from fleetline.agents.simulator import ClusterSpec, Fault
from fleetline.errors import InvalidEventError
from fleetline.processors.operations.fold import (
    Audited,
    Command,
    OpsFold,
    OpsPolicy,
    SchedulerCall,
    TicketChanged,
)
from fleetline.processors.operations.forecast import (
    back_test,
    capacity_plan,
    simulated_demand,
)
from fleetline.processors.operations.rules import HealingRules, observe
from fleetline.processors.scheduling.capacity import ClusterFacts
from fleetline.processors.scheduling.codec import canonical_json
from fleetline.processors.scheduling.effects import WorkloadOrder
from fleetline.processors.scheduling.energy import HOUR_MS, EnergyProfile, best_start
from fleetline.processors.view.model import ClusterHealth
from tests.scheduling_support import THREE, Driver, fleet_view, training
from tests.support import BASE_MS

T0 = 1_000_000_000_000
XID = {
    "node_id": "n1",
    "cluster_id": "c1",
    "rule": "gpu_failed",
    "severity": "CRITICAL",
    "summary": "GPU 3 failed: xid 79",
    "evidence": {"gpu": 3, "xid_codes": [79]},
}


class Ops:
    """Feeds an OpsFold events at positions 0, 1, ... and keeps every effect."""

    def __init__(self, policy: OpsPolicy | None = None) -> None:
        self.fold = OpsFold()
        self.position = 0
        self.effects: list[Any] = []
        if policy is not None:
            self.feed("OPS_POLICY", T0, policy.as_data())

    def feed(self, kind: str, ts: int, payload: dict[str, Any], key: str = "") -> list[Any]:
        event = {
            "event_id": f"e{self.position}",
            "kind": kind,
            "ts": ts,
            "key": key,
            "actor": "tester",
            "payload_json": json.dumps(payload),
        }
        effects = self.fold.step(event, self.position)
        self.position += 1
        self.effects += effects
        return effects

    def observe(self, ts: int, findings=(), loads=None, skipped=()) -> list[Any]:
        return self.feed(
            "OBSERVE",
            ts,
            {"findings": list(findings), "loads": loads or {}, "skipped_clusters": list(skipped)},
        )

    def move(self, ts: int, ticket_id: str, state: str) -> list[Any]:
        return self.feed("TICKET_UPDATE", ts, {"state": state, "note": "t"}, key=ticket_id)


def kinds(effects: list[Any]) -> list[str]:
    out = []
    for e in effects:
        if isinstance(e, (Command, SchedulerCall)):
            out.append(e.kind)
        elif isinstance(e, TicketChanged):
            out.append(f"ticket:{e.ticket['state']}")
        elif isinstance(e, Audited):
            out.append(e.operation)
    return out


def test_a_failed_gpu_cordons_and_drains_its_node_and_opens_a_ticket_with_the_evidence():
    ops = Ops(OpsPolicy(burn_in_ms=10_000))
    effects = ops.observe(T0 + 1000, [XID])
    assert kinds(effects) == ["ticket:OPEN", "CORDON", "FENCE", "ops.cordon"]
    ticket = effects[0].ticket
    assert ticket["node_id"] == "n1" and ticket["severity"] == "CRITICAL"
    assert ticket["evidence"][0]["evidence"]["xid_codes"] == [79]
    assert ticket["evidence"][0]["ts"] == T0 + 1000
    # The same standing failure seen again adds nothing; a new reading is more evidence.
    assert ops.observe(T0 + 2000, [XID]) == []
    more = {**XID, "rule": "thermal", "summary": "GPU 3 at 95 C"}
    (changed,) = ops.observe(T0 + 3000, [XID, more])
    assert [e["rule"] for e in changed.ticket["evidence"]] == [
        "gpu_failed",
        "gpu_failed",
        "thermal",
    ]
    # Command ids come from the log position: a replay issues the same ones.
    cordon = next(e for e in ops.effects if isinstance(e, Command))
    assert cordon.command_id == f"ops-1-CORDON-n1-{ticket['ticket_id']}"


def test_a_repaired_node_returns_only_after_a_clean_burn_in_and_a_refailure_escalates():
    ops = Ops(OpsPolicy(burn_in_ms=10_000, refail_window_ms=3_600_000))
    ticket_id = ops.observe(T0, [XID])[0].ticket["ticket_id"]
    with pytest.raises(InvalidEventError, match="'CLOSED' is not one of"):
        ops.move(T0 + 1, ticket_id, "CLOSED")  # only a burn-in closes a ticket
    assert kinds(ops.move(T0 + 10, ticket_id, "IN_REPAIR")) == [
        "ticket:IN_REPAIR",
        "ops.ticket.in_repair",
    ]
    with pytest.raises(InvalidEventError, match="is IN_REPAIR; IN_REPAIR needs one of OPEN"):
        ops.move(T0 + 15, ticket_id, "IN_REPAIR")
    ops.move(T0 + 20, ticket_id, "REPAIRED")
    assert ops.fold.tickets[ticket_id].state == "VERIFYING"
    # A finding during the burn-in sends it back to repair, with that evidence.
    (back, _) = ops.observe(T0 + 1000, [{**XID, "summary": "GPU 3 failed: xid 48"}])
    assert back.ticket["state"] == "IN_REPAIR" and "burn-in failed" in back.ticket["reason"]
    ops.move(T0 + 2000, ticket_id, "REPAIRED")
    assert ops.observe(T0 + 5000) == []  # clean, but the burn-in has not run its time
    # Its cluster out of reach: no verdict.
    assert ops.observe(T0 + 13_000, skipped=["c1"]) == []
    returned = ops.observe(T0 + 13_000)
    assert kinds(returned) == [
        "ticket:CLOSED",
        "ops.ticket.closed",
        "UNCORDON",
        "UNFENCE",
        "ops.return",
    ]
    history = [(h["from"], h["to"]) for h in ops.fold.tickets[ticket_id].history]
    assert history == [
        (None, "OPEN"),
        ("OPEN", "IN_REPAIR"),
        ("IN_REPAIR", "VERIFYING"),
        ("VERIFYING", "IN_REPAIR"),
        ("IN_REPAIR", "VERIFYING"),
        ("VERIFYING", "CLOSED"),
    ]
    # Failing again within the window of its return: escalated, not put back in the pool.
    again = ops.observe(T0 + 60_000, [XID])
    assert kinds(again)[:3] == ["ticket:ESCALATED", "CORDON", "FENCE"]
    assert "failed again 47 s after it was returned" in again[0].ticket["reason"]


def test_a_flapping_node_is_escalated():
    ops = Ops(OpsPolicy(burn_in_ms=1000, flap_limit=3, refail_window_ms=1, flap_window_ms=600_000))
    states, reasons = [], []
    for n in range(3):
        start = T0 + n * 100_000
        ticket = ops.observe(start, [XID])[0].ticket
        states.append(ticket["state"])
        reasons.append(ticket["reason"])
        ops.move(start + 10, ticket["ticket_id"], "REPAIRED")
        ops.observe(start + 5_000)  # burn-in passes: returned
    assert states == ["OPEN", "OPEN", "ESCALATED"]
    assert "tripped 3 times in 600 s (flapping): escalated" in reasons[-1]


def test_self_healing_and_power_capping_can_be_switched_off():
    ops = Ops(OpsPolicy(self_healing=False, power_capping=False, idle_ms=0))
    assert ops.observe(T0, [XID], {"n1": ["c1", 0, 8, 700.0]}) == []
    assert ops.fold.tickets == {}


def test_idle_nodes_are_capped_at_low_load_and_restored_when_work_returns():
    ops = Ops(OpsPolicy(idle_ms=60_000, low_load=0.3, high_load=0.6, low_cap_w=300))
    loads = {"n1": ["c1", 0, 8, 700.0], "n2": ["c1", 2, 8, 700.0]}
    assert ops.observe(T0, loads=loads) == []  # idle, but not for long enough
    capped = ops.observe(T0 + 60_000)
    assert [(e.kind, e.node_id, e.power_cap_w) for e in capped] == [("SET_POWER_CAP", "n1", 300)]
    assert "cluster c1 at 12%" in capped[0].reason
    assert ops.observe(T0 + 61_000, loads={"n1": ["c1", 0, 8, 300.0]}) == []
    restored = ops.observe(T0 + 62_000, loads={"n1": ["c1", 8, 8, 300.0]})
    assert [(e.kind, e.node_id, e.power_cap_w) for e in restored] == [("SET_POWER_CAP", "n1", 700)]


def test_a_partial_observation_updates_loads_and_judges_nothing():
    ops = Ops(OpsPolicy(burn_in_ms=1000, idle_ms=0))
    ticket_id = ops.observe(T0, [XID])[0].ticket["ticket_id"]
    ops.move(T0 + 1, ticket_id, "REPAIRED")
    # Past the burn-in, but the findings are in the observation's last part, not this one.
    partial = {"loads": {"n9": ["c1", 0, 8, 700.0]}, "partial": True}
    assert ops.feed("OBSERVE", T0 + 5000, partial) == []
    assert ops.fold.tickets[ticket_id].state == "VERIFYING" and "n9" in ops.fold.nodes
    assert kinds(ops.observe(T0 + 5001))[:1] == ["ticket:CLOSED"]


def test_the_fold_restored_from_its_records_decides_as_the_one_that_ran():
    ops = Ops(OpsPolicy(burn_in_ms=1000, idle_ms=0))
    ops.observe(T0, [XID], {"n2": ["c1", 0, 8, 700.0]})
    restored = OpsFold.from_records(dict(ops.fold.records()))
    event = {
        "event_id": "x",
        "kind": "OBSERVE",
        "ts": T0 + 5,
        "key": "",
        "actor": "",
        "payload_json": json.dumps({"findings": [{**XID, "node_id": "n3"}]}),
    }
    assert restored.step(dict(event), 9) == ops.fold.step(dict(event), 9)


def test_rules_find_a_failed_gpu_with_its_xid_and_skip_a_lost_cluster():
    view, _ = fleet_view(
        [ClusterSpec("us-east-a", "us-east", 2)],
        4,
        [Fault("xid", "us-east-a-n0001/5", BASE_MS + 1500, None, 79)],
    )
    seen = observe(view, HealingRules())
    failed = [f for f in seen.findings if f.rule == "gpu_failed"]
    assert [(f.node_id, f.evidence["gpu"]) for f in failed] == [("us-east-a-n0001", 5)]
    assert failed[0].evidence["cause"] == "xid 79" and failed[0].severity == "CRITICAL"
    assert set(seen.loads) == {"us-east-a-n0000", "us-east-a-n0001"}


def test_a_cheap_observation_answers_from_the_node_epoch_and_sees_a_new_failure():
    from tests.scheduling_support import advance

    view, sim = fleet_view([ClusterSpec("us-east-a", "us-east", 2)], 2)
    cache: dict = {}
    first = observe(view, HealingRules(), readings=False, health_cache=cache)
    assert first.findings == [] and set(cache) == {"us-east-a-n0000", "us-east-a-n0001"}
    # A threshold on the readings is judged only by a full observation.
    hot = HealingRules(max_temperature_c=0.0)
    assert observe(view, hot, readings=False, health_cache=cache).findings == []
    assert {f.rule for f in observe(view, hot).findings} == {"thermal"}
    sim.add_fault(Fault("xid", "us-east-a-n0000/2", BASE_MS + 2500, None, 48))
    advance(view, sim, 3, 3)
    (failed,) = observe(view, HealingRules(), readings=False, health_cache=cache).findings
    assert (failed.node_id, failed.rule, failed.evidence["gpu"]) == (
        "us-east-a-n0000",
        "gpu_failed",
        2,
    )


def test_a_lossy_leaf_needs_repair_only_past_the_rule_s_threshold():
    def leaf(loss: float):
        view, _ = fleet_view(
            [ClusterSpec("eu-west-a", "eu-west", 2)],
            3,
            [Fault("rdma_loss", "eu-west-a-leaf000", BASE_MS, None, loss)],
        )
        return observe(view, HealingRules()).findings

    # 2 %: degraded in the view (light jobs may still use it), no ticket.
    assert leaf(0.02) == []
    lossy = leaf(0.08)
    assert {f.node_id for f in lossy} == {"eu-west-a-n0000", "eu-west-a-n0001"}
    assert {f.rule for f in lossy} == {"rdma_loss"} and lossy[0].evidence[
        "rdma_packet_loss_ratio"
    ] == 0.08
    strict = fleet_view(
        [ClusterSpec("eu-west-a", "eu-west", 2)],
        3,
        [Fault("rdma_loss", "eu-west-a-leaf000", BASE_MS, None, 0.02)],
    )[0]
    tripped = observe(strict, HealingRules(degraded_trips=True)).findings
    assert {f.rule for f in tripped} == {"gpu_degraded"}


# -- the scheduler: fences, energy, deferral ---------------------------------------------------


def test_a_fenced_node_is_drained_through_a_checkpoint_and_takes_no_new_work():
    view, _ = fleet_view([ClusterSpec("us-east-a", "us-east", 2)], 2)
    d = Driver(view)
    d.submit(training("j"))
    (node,) = d.nodes_of("acme/j")
    effects = d.feed(d._request("FENCE", node, "", detail="ticket T1: GPU 3 failed"))
    stop = next(e for e in effects if isinstance(e, WorkloadOrder) and e.action == "STOP")
    assert stop.final_checkpoint, "a drain checkpoints on its way out"
    assert "drained (ticket T1" in d.decisions("acme/j", "PREEMPTED")[-1].reason
    d.tick()
    assert d.last("acme/j").outcome == "PLACED" and d.nodes_of("acme/j") != {node}
    d.submit(training("k"))
    assert d.last("acme/k").outcome == "QUEUED"  # the only other node is fenced
    d.feed(d._request("UNFENCE", node, ""))
    d.tick()
    assert d.nodes_of("acme/k") == {node}


def _cluster(cluster_id: str, price: float = 0.1, pue: float = 1.2) -> ClusterFacts:
    return ClusterFacts(cluster_id, "r", "ON_PREM", 2.0, price, pue, {}, ClusterHealth.HEALTHY)


def test_best_start_waits_for_the_cheap_hours_and_keeps_the_deadline():
    night = [0.05] * 6 + [0.30] * 18  # cheap from 00:00 to 06:00 UTC
    profile = EnergyProfile("a", tuple(night), tuple([0.0] * 24))
    day = 20 * HOUR_MS  # 20:00 UTC on day 0
    deferral = best_start(
        day, day + 12 * HOUR_MS, 2 * HOUR_MS, [_cluster("a")], {"a": profile}, 0.5, 0.05, 0
    )
    assert deferral is not None and deferral.start_ms == 24 * HOUR_MS
    assert deferral.price_then == pytest.approx(0.05 * 1.2)
    assert "starts at 00:00 UTC" in deferral.reason()
    # A deadline that leaves no time to wait: start now.
    assert (
        best_start(
            day, day + 2 * HOUR_MS, 2 * HOUR_MS, [_cluster("a")], {"a": profile}, 0.5, 0.05, 0
        )
        is None
    )
    # Flat prices: nothing to gain by waiting.
    flat = EnergyProfile("a", tuple([0.1] * 24), tuple([0.0] * 24))
    assert (
        best_start(day, day + 12 * HOUR_MS, HOUR_MS, [_cluster("a")], {"a": flat}, 0.5, 0.05, 0)
        is None
    )
    # A green hour counts: renewable share discounts the price by the policy's weight.
    sunny = EnergyProfile(
        "a", tuple([0.1] * 24), tuple([0.9 if 10 <= h < 14 else 0.0 for h in range(24)])
    )
    green = best_start(
        8 * HOUR_MS, 20 * HOUR_MS, HOUR_MS, [_cluster("a")], {"a": sunny}, 0.5, 0.05, 0
    )
    assert green is not None and green.start_ms == 10 * HOUR_MS


def test_a_deferrable_job_waits_for_the_cheap_window_then_places_and_says_why():
    view, _ = fleet_view(THREE, 2)
    d = Driver(view)
    now = d.now_ms
    windows = [{"from_ms": now + 600_000, "to_ms": now + 7_200_000, "price_per_kwh": 0.01}]
    for cluster in ("us-east-a", "eu-west-a", "ap-south-a"):
        profile = {"cluster_id": cluster, "price_per_kwh": [0.4] * 24, "windows": windows}
        d.feed(d._request("ENERGY", cluster, "", spec_json=canonical_json(profile)))
    deadline = datetime.fromtimestamp((now + 4 * 3_600_000) / 1000, UTC).isoformat()
    d.submit(training("night", deferrable={"deadline": deadline, "expected_runtime": "1h"}))
    waiting = d.last("acme/night")
    assert waiting.outcome == "QUEUED" and "deferred to a cheaper window" in waiting.reason
    assert d.job("acme/night").deferred_until_ms == now + 600_000
    d.tick(seconds=300)
    assert d.last("acme/night").outcome == "QUEUED"
    d.tick(seconds=301)
    assert d.last("acme/night").outcome == "PLACED"
    # A job without the flag starts at once, priced by the energy term where it is cheapest.
    d.submit(training("now"))
    assert d.last("acme/now").outcome == "PLACED"
    assert "energy" in d.last("acme/now").alternatives[0].parts


def test_deferred_jobs_take_none_of_a_pass_s_attempts():
    view, _ = fleet_view([ClusterSpec("us-east-a", "us-east", 1)], 2)
    d = Driver(view)
    now = d.now_ms
    window = [{"from_ms": now + 3_600_000, "to_ms": now + 7_200_000, "price_per_kwh": 0.01}]
    profile = {"cluster_id": "us-east-a", "price_per_kwh": [0.4] * 24, "windows": window}
    d.feed(d._request("ENERGY", "us-east-a", "", spec_json=canonical_json(profile)))
    d.submit(training("block"))  # the cluster's 8 GPUs
    deadline = datetime.fromtimestamp((now + 6 * 3_600_000) / 1000, UTC).isoformat()
    for n in range(d.scheduler.policy.pass_attempts + 1):
        d.submit(
            training(f"later-{n}", deferrable={"deadline": deadline, "expected_runtime": "1h"})
        )
    d.submit(training("waiting"))
    assert d.last("acme/waiting").outcome == "QUEUED"
    d.delete("acme/block")
    d.tick(seconds=1)
    # The pass went past the 65 deferred jobs ahead of it in the queue to the one that can run.
    assert d.last("acme/waiting").outcome == "PLACED"


# -- forecasting ------------------------------------------------------------------------------


def test_the_forecast_beats_the_seasonal_naive_baseline_on_a_simulated_year():
    year = simulated_demand(52, seed=11)
    result = back_test(year, weeks_held_out=4, folds=4)
    assert result.folds == 4
    assert result.model_smape < result.baseline_smape, result
    assert 0.8 <= result.coverage <= 0.97


def test_a_capacity_plan_names_the_first_hour_demand_crosses_capacity():
    year = simulated_demand(26, seed=3, growth_per_week=10.0)
    hours = list(range(1000, 1000 + len(year)))
    plan = capacity_plan(
        hours, list(year), capacity_gpus=int(year.max()), horizon_weeks=8, lead_time_h=24 * 28
    )
    crossing = plan["crossing"]
    assert isinstance(crossing, dict) and crossing["hours_ahead"] < 8 * 168
    assert crossing["needed_gpus"] > year.max()
    assert plan["back_test"] is not None
    roomy = capacity_plan(hours, list(year), capacity_gpus=10_000, horizon_weeks=2, lead_time_h=0)
    assert roomy["crossing"] is None
    with pytest.raises(ValueError, match="two weeks"):
        capacity_plan(hours[:100], list(year[:100]), 100, 1, 0)


# -- tuning -----------------------------------------------------------------------------------


def test_daly_s_interval_is_young_s_to_first_order_and_caps_at_the_mtbf():
    from fleetline.processors.operations.tuning import daly_interval_s

    # C << M: sqrt(2CM) within a few per cent.
    assert daly_interval_s(10, 36_000) == pytest.approx((2 * 10 * 36_000) ** 0.5, rel=0.02)
    # A costlier checkpoint or a shorter MTBF moves it the way the formula says.
    assert daly_interval_s(40, 36_000) > daly_interval_s(10, 36_000)
    assert daly_interval_s(10, 9_000) < daly_interval_s(10, 36_000)
    assert daly_interval_s(100, 40) == 40


def test_a_checkpoint_recommendation_shows_its_inputs_and_a_tuned_spec_is_applied_by_policy():
    from fleetline.processors.operations.tuning import batch_size, checkpoint_interval

    rec = checkpoint_interval(
        "acme/j", 64, 1800, failures=3, gpu_hours=50_000, checkpoint_seconds=[20, 30, 25]
    )
    assert rec is not None
    assert rec.inputs["checkpoint_cost_s"] == 25 and rec.inputs["failures"] == 3
    mtbf = 3600 / ((3 + 0.5) / 50_000 * 64)
    assert rec.inputs["job_mtbf_s"] == pytest.approx(mtbf, rel=1e-3)
    assert rec.recommended == pytest.approx((2 * 25 * mtbf) ** 0.5, rel=0.05)
    assert checkpoint_interval("acme/j", 64, 1800, 3, 50_000, []) is None  # nothing measured
    hint = batch_size("acme/j", fb_used_p95_mib=30_000, fb_total_mib=80_000)
    assert hint is not None and hint.recommended == pytest.approx(2.4)
    assert batch_size("acme/j", 60_000, 80_000) is None  # within 25 %: not worth saying
    document = training("j")
    payload = {**rec.as_data(), "document": document}
    off = Ops()
    assert kinds(off.feed("RECOMMENDATION", T0, payload, key="acme/j")) == ["ops.recommend"]
    on = Ops(OpsPolicy(auto_tune_checkpoints=True))
    effects = on.feed("RECOMMENDATION", T0, payload, key="acme/j")
    (call,) = [e for e in effects if isinstance(e, SchedulerCall)]
    assert (call.kind, call.key, call.tenant) == ("SUBMIT", "acme/j", "acme")
    tuned = json.loads(call.spec_json)
    assert tuned["spec"]["checkpoint_interval_s"] == round(rec.recommended)
    assert on.fold.recommendations[-1]["applied"] is True
    assert "document" not in on.fold.recommendations[-1]


def test_a_tuned_checkpoint_interval_keeps_the_job_where_it_runs():
    view, _ = fleet_view([ClusterSpec("us-east-a", "us-east", 2)], 2)
    d = Driver(view)
    first = d.submit(training("j", checkpoint_interval_s=1800))
    (started,) = [e for e in first if isinstance(e, WorkloadOrder)]
    before = d.nodes_of("acme/j")
    tuned = d.submit(training("j", checkpoint_interval_s=600))
    assert d.nodes_of("acme/j") == before and d.job("acme/j").phase == "Running"
    assert d.job("acme/j").interval_ms == 600_000
    assert d.last("acme/j").outcome == "PLACED"  # no release, no new placement
    # The running workload is told: the same run's order again, with the tuned spec.
    (retold,) = [e for e in tuned if isinstance(e, WorkloadOrder)]
    assert (retold.action, retold.cluster_id, retold.epoch, retold.attempt) == (
        "RUN",
        started.cluster_id,
        started.epoch,
        started.attempt,
    )
    assert retold.reason == "checkpoint interval 1800 s -> 600 s"
    assert json.loads(retold.spec_json or "{}")["spec"]["checkpoint_interval_s"] == 600
    # A change the workload is not told of (its priority) orders nothing.
    again = d.submit(training("j", checkpoint_interval_s=600, priority="high"))
    assert not [e for e in again if isinstance(e, WorkloadOrder)]


def test_a_bad_energy_profile_is_refused_with_the_reason():
    view, _ = fleet_view([ClusterSpec("us-east-a", "us-east", 1)], 2)
    d = Driver(view)
    for profile, reason in (
        ({"cluster_id": "us-east-a", "price_per_kwh": [0.1] * 23}, "needs 24 hourly values"),
        (
            {"cluster_id": "us-east-a", "price_per_kwh": [0.1] * 24, "renewable_share": [2] * 24},
            "renewable_share is a fraction",
        ),
        ({"cluster_id": "eu-west-a", "price_per_kwh": [0.1] * 24}, "carries the profile of"),
        ({"cluster_id": "us-east-a", "price_per_kwh": [0.1] * 24, "pue": 0.5}, "pue 0.5 < 1"),
    ):
        with pytest.raises(InvalidEventError, match=reason):
            d.feed(d._request("ENERGY", "us-east-a", "", spec_json=canonical_json(profile)))
    assert d.scheduler.energy == {}


def test_a_bad_operations_policy_file_names_what_is_wrong(tmp_path):
    from fleetline.errors import ConfigError
    from fleetline.processors.operations.runtime import load_ops_policy

    good = tmp_path / "ops.yaml"
    good.write_text("self_healing: false\nburn_in_ms: 5000\nrules: {max_temperature_c: 85}\n")
    policy, rules = load_ops_policy(str(good))
    assert policy is not None and not policy.self_healing and policy.burn_in_ms == 5000
    assert rules.max_temperature_c == 85.0
    for text, named in (
        ("bogus: 1\n", "operations policy: unknown fields ['bogus']"),
        ("rules: {nope: 2}\n", "healing rules: unknown fields ['nope']"),
        ("burn_in_ms: soon\n", "operations policy: invalid literal"),
        ("- a list\n", "must be a mapping"),
    ):
        bad = tmp_path / "bad.yaml"
        bad.write_text(text)
        with pytest.raises(ConfigError, match=re.escape(named)):
            load_ops_policy(str(bad))


def test_the_operations_processor_tunes_on_its_own_schedule_as_itself() -> None:
    """`serve` makes the recommendations `fleetline tune` would every `recommend_every_s`,
    appended as the operations processor's; a round whose store does not answer is skipped."""
    from fleetline.config import KafkaSettings
    from fleetline.errors import StorageError
    from fleetline.processors.operations.runtime import OpsService, recommendation_events
    from fleetline.processors.view.model import ResourceView
    from fleetline.processors.view.read import StaticView
    from fleetline.streams.topics import Topics

    job = {
        "key": "acme/big",
        "phase": "Running",
        "kind": "TrainingJob",
        "allocation": {"c1": {"n1": 255}},
        "document": {"kind": "TrainingJob", "spec": {"checkpoint_interval_s": 1800}},
    }

    def rows(query: str) -> list[list]:
        if "gpu_hours" in query:
            return [["c1", "H100", 6, 500.0]]
        if "checkpoint_seconds" in query:
            return [["acme/big", [120.0, 130.0]]]
        return []

    rounds: list[int] = []

    def recommend(ts: int) -> list:
        rounds.append(ts)
        if len(rounds) == 2:
            raise StorageError("the store is down")
        return recommendation_events(rows, [job], ts, "operations")

    class Producer:
        def __init__(self) -> None:
            self.sent: list[tuple[str, bytes]] = []

        def produce(self, topic: str, **kwargs) -> None:
            self.sent.append((topic, kwargs["value"]))

    topics = Topics("unit-ops")
    service = OpsService(KafkaSettings(), topics, StaticView(ResourceView()), recommend=recommend)
    producer = Producer()
    service._recommend(producer)
    service._recommend(producer)  # the store down: skipped, said in the log
    assert len(rounds) == 2 and service.recommended == len(producer.sent) > 0
    event = service.codec.decode(producer.sent[0][1]).record
    assert event["kind"] == "RECOMMENDATION" and event["actor"] == "operations"
    assert {t for t, _ in producer.sent} == {topics.ops}
