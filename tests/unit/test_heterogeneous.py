"""Task-aware placement over a fleet of different chips: the accelerator catalogue, the work
estimate, precision, deadlines, and gangs that never mix kinds of chip."""

from __future__ import annotations

import datetime as dt

import pytest

from fleetline.agents.simulator import ClusterSpec, FleetSimulator, cluster_info
from fleetline.errors import ConfigError
from fleetline.processors.scheduling.estimate import WorkSize, estimate
from fleetline.processors.view.accelerators import Accelerator
from fleetline.processors.view.catalogue import builtin, parse_catalogue
from fleetline.processors.view.model import ResourceView
from tests.fleet_events import fold
from tests.scheduling_support import Driver, advance, training
from tests.support import BASE_MS

NOW_MS = BASE_MS + 10_000


def mixed_fleet(clusters: list[tuple[ClusterSpec, float]], faults=()) -> ResourceView:
    """A view of simulated clusters, each at its own price per GPU-hour."""
    return mixed_fleet_and_simulator(clusters, faults)[0]


def mixed_fleet_and_simulator(
    clusters: list[tuple[ClusterSpec, float]], faults=()
) -> tuple[ResourceView, FleetSimulator]:
    sim = FleetSimulator([c for c, _ in clusters], seed=5, faults=list(faults))
    events: list[tuple[str, dict]] = []
    for spec, price in clusters:
        info = cluster_info(spec, 1, BASE_MS)
        info.update(price_per_gpu_hour=price, energy_price_per_kwh=0.0)
        events.append(("ClusterInfo", info))
    events += [("NodeState", r) for r in sim.initial_states(BASE_MS)]
    view = fold(events)
    advance(view, sim, 1, 2)
    return view, sim


FLEET = [
    (ClusterSpec("h100-a", "eu-west", 2), 2.40),
    (ClusterSpec("mi300x-a", "us-east", 2, model="AMD Instinct MI300X"), 2.10),
    (ClusterSpec("a100-a", "us-east", 2, model="NVIDIA A100-SXM4-80GB"), 1.20),
    (ClusterSpec("tpu-a", "ap-south", 4, model="SimTPU T1 16GB"), 0.90),
]


def sized(name: str, pflop: float, steps: int, accelerator: str | None = None, **extra) -> dict:
    work = {"pflop_per_step": pflop, "steps": steps}
    return training(name, accelerator=accelerator, work=work, **extra)


def test_the_estimate_is_the_work_over_the_chips_effective_throughput() -> None:
    work = WorkSize(pflop_per_step=3.2, steps=1000, precision="bf16")
    h100 = Accelerator("nvidia", "h100-80gb-hbm3", 81559)
    found = estimate(work, h100, gpus=8, cost_per_gpu_hour=2.0, now_ms=0, catalogue=builtin())
    assert found is not None
    # 3,200 TFLOP over 8 x 989 TFLOPS x 0.40: 1.011 s a step.
    assert found.step_s == pytest.approx(3200 / (8 * 989 * 0.40))
    assert found.cost == pytest.approx(found.run_s / 3600 * 8 * 2.0)
    assert "bf16 989 TFLOPS x 0.4 of peak" in found.describe()
    a100 = Accelerator("nvidia", "a100-sxm4-80gb", 81920)
    fp8 = WorkSize(3.2, 1000, "fp8")
    assert estimate(fp8, a100, 8, 2.0, 0, builtin()) is None  # no fp8 arithmetic on an A100


def test_a_sized_job_lands_on_the_chip_with_the_most_work_per_cost_and_says_why() -> None:
    driver = Driver(mixed_fleet(FLEET), now_ms=NOW_MS)
    driver.submit(sized("big", pflop=3.2, steps=2000))
    decision = driver.last("acme/big")
    # The MI300X's 1307 x 0.32 bf16 TFLOPS at 2.10 beat the H100's 989 x 0.40 at 2.40 and
    # the A100's 312 x 0.45 at 1.20 per unit of work; the TPU-like hosts have four chips.
    assert decision.cluster_id == "mi300x-a"
    assert "est. " in decision.reason and "on 8 mi300x (bf16 1307.4 TFLOPS x 0.32 of peak)" in (
        decision.reason
    )
    parts = {s.cluster_id: s.parts for s in decision.alternatives if s.rejected is None}
    assert parts["mi300x-a"]["work"] == 1.0
    assert parts["mi300x-a"]["work"] > parts["h100-a"]["work"] > parts["a100-a"]["work"]


def test_a_deadline_the_cheapest_chip_would_miss_goes_to_one_that_meets_it() -> None:
    a100_cheap = (ClusterSpec("a100-a", "us-east", 2, model="NVIDIA A100-SXM4-80GB"), 0.60)
    view = mixed_fleet([FLEET[0], a100_cheap])
    # Per unit of work the A100s at 0.60 are cheaper (0.60 / 140 vs 2.40 / 396 effective
    # TFLOPS) but 2.8x slower.
    relaxed = Driver(view, now_ms=NOW_MS)
    relaxed.submit(sized("j", pflop=3.2, steps=10_000))
    assert relaxed.last("acme/j").cluster_id == "a100-a"
    # 10,000 steps: 2.8 h on the H100s, 7.9 h on the A100s; due in 4 hours.
    due = dt.datetime.fromtimestamp((NOW_MS + 4 * 3_600_000) / 1000, dt.UTC).isoformat()
    urgent = Driver(view, now_ms=NOW_MS)
    document = sized("j", pflop=3.2, steps=10_000)
    document["spec"]["work"]["deadline"] = due
    urgent.submit(document)
    decision = urgent.last("acme/j")
    assert decision.cluster_id == "h100-a"
    assert "finishes before its deadline" in decision.reason
    a100 = next(s for s in decision.alternatives if s.cluster_id == "a100-a")
    assert a100.parts["work"] == 0.5  # cheaper, but it would finish after the deadline
    # `within` says the same relative to the submission.
    relative = Driver(view, now_ms=NOW_MS)
    document = sized("j", pflop=3.2, steps=10_000)
    document["spec"]["work"]["within"] = "4h"
    relative.submit(document)
    assert relative.last("acme/j").reason == decision.reason
    both = sized("k", pflop=1, steps=1)
    both["spec"]["work"].update(within="4h", deadline=due)
    relative.submit(both)
    assert "give a deadline or `within`, not both" in relative.last("acme/k").reason


def test_a_precision_only_some_chips_have_keeps_the_job_off_the_others() -> None:
    driver = Driver(mixed_fleet(FLEET), now_ms=NOW_MS)
    driver.submit(sized("fp8", pflop=3.2, steps=100, precision="fp8"))
    decision = driver.last("acme/fp8")
    assert decision.cluster_id in ("mi300x-a", "h100-a")
    rejected = {s.cluster_id: s.rejected for s in decision.alternatives if s.rejected}
    assert rejected["a100-a"] == ("has no GPUs computing fp8 (it has nvidia a100-sxm4-80gb 80 GiB)")


def test_a_precision_no_chip_in_the_fleet_has_waits_with_that_reason() -> None:
    driver = Driver(mixed_fleet(FLEET[2:]), now_ms=NOW_MS)  # A100s and TPU-like chips
    driver.submit(sized("fp8", pflop=3.2, steps=100, precision="fp8", per_worker=4, tensor=4))
    decision = driver.last("acme/fp8")
    assert decision.outcome == "QUEUED"
    assert "no chip in the fleet computes fp8" in decision.reason


def test_a_job_without_a_size_is_scored_as_before() -> None:
    driver = Driver(mixed_fleet(FLEET), now_ms=NOW_MS)
    driver.submit(training("plain", accelerator=None))
    decision = driver.last("acme/plain")
    assert decision.alternatives and all("work" not in s.parts for s in decision.alternatives)
    assert "est." not in decision.reason


def test_a_gang_in_a_cluster_of_two_chips_takes_one_kind_the_one_estimated() -> None:
    # One cluster, H100 and MI300X nodes side by side (two clusters' nodes, one cluster id).
    sim_h100 = FleetSimulator([ClusterSpec("mixed", "eu-west", 2)], seed=5)
    sim_mi = FleetSimulator(
        [ClusterSpec("mixed-amd", "eu-west", 2, model="AMD Instinct MI300X")], seed=6
    )
    events: list[tuple[str, dict]] = [
        ("ClusterInfo", cluster_info(ClusterSpec("mixed", "eu-west", 2), 1, BASE_MS))
    ]
    for sim in (sim_h100, sim_mi):
        for record in sim.initial_states(BASE_MS):
            events.append(("NodeState", {**record, "cluster_id": "mixed"}))
    view = fold(events)
    for sim in (sim_h100, sim_mi):
        for t in (1, 2):
            fold(
                [
                    ("NodeTelemetry", {**r, "cluster_id": "mixed"})
                    for r in sim.telemetry(BASE_MS + t * 1000)
                ],
                view,
            )
    driver = Driver(view, now_ms=NOW_MS)
    driver.submit(sized("two", pflop=6.4, steps=100, workers=2))
    nodes = driver.nodes_of("acme/two")
    assert len(nodes) == 2 and {n.split("-n")[0] for n in nodes} == {"mixed-amd"}
    assert "on 16 mi300x" in driver.last("acme/two").reason


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"memory_gb": None}, "h100-80gb-hbm3: memory_gb must be a number, not None"),
        ({"power_w": -700}, "h100-80gb-hbm3: power_w is -700; a figure may not be negative"),
        ({"efficiency": 1.5}, "efficiency is a share of peak, above 0 and at most 1"),
        ({"peak_tflops": {"fp32": 67, "bf16": 989, "int8": 1979}}, "peak_tflops.fp8 is missing"),
        ({"source": ""}, "h100-80gb-hbm3: source must be named"),
        ({"watts": 1}, "unknown fields ['watts']"),
    ],
)
def test_a_catalogue_entry_with_a_bad_figure_is_refused_naming_it(change, message) -> None:
    record = builtin().models["h100-80gb-hbm3"].as_record()
    entry: dict = {k: v for k, v in record.items() if k not in ("model", "interconnect_gbps")}
    entry["interconnect"] = {"name": record["interconnect"], "bandwidth_gbps": 900}
    parse_catalogue({"models": {"h100-80gb-hbm3": entry}})  # as shipped: accepted
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse_catalogue({"models": {"h100-80gb-hbm3": {**entry, **change}}})
    missing = {k: v for k, v in entry.items() if k != "memory_bandwidth_gbps"}
    with pytest.raises(ConfigError, match="h100-80gb-hbm3: memory_bandwidth_gbps is missing"):
        parse_catalogue({"models": {"h100-80gb-hbm3": missing}})


def test_every_simulated_chip_is_in_the_catalogue_with_its_source() -> None:
    from fleetline.agents.devices.simulated import PROFILES
    from fleetline.processors.view.accelerators import normalise_model

    catalogue = builtin()
    for name, chip in PROFILES.items():
        entry = catalogue.models[normalise_model(name)]
        assert entry.vendor == chip.vendor and entry.source


def test_checkpoint_reports_measure_a_model_s_share_of_peak_and_estimates_use_it() -> None:
    from fleetline.processors.scheduling.effects import WorkloadOrder
    from fleetline.processors.scheduling.scheduler import Scheduler

    driver = Driver(mixed_fleet(FLEET[:1]), now_ms=NOW_MS)  # the H100s alone
    driver.submit(sized("first", pflop=2.0, steps=10_000, accelerator="h100"))
    (order,) = [
        e
        for e in driver.effects
        if isinstance(e, WorkloadOrder) and e.job == "acme/first" and e.action == "RUN"
    ]
    # 100 steps a minute on 8 H100s: 100 x 2,000 TFLOP over 60 s x 8 x 989 TFLOPS = 0.421.
    for n in range(4):
        driver.tick(60)
        driver.report(order, "CHECKPOINT", step=100 * (n + 1), checkpoint_ms=driver.now_ms)
    # A report whose steps the stated size cannot explain (above peak) measures nothing.
    driver.tick(1)
    driver.report(order, "CHECKPOINT", step=10_000, checkpoint_ms=driver.now_ms)
    measured = driver.scheduler.measured["h100-80gb-hbm3/bf16"]
    assert measured.intervals == 3
    assert measured.efficiency == pytest.approx(200_000 / (60 * 8 * 989), rel=1e-9)
    driver.submit(sized("second", pflop=2.0, steps=1000, accelerator="h100"))
    assert "bf16 989 TFLOPS x 0.421 of peak measured over 3 intervals" in (
        driver.last("acme/second").reason
    )
    # The measurement is state of record: a scheduler restored from its records keeps it.
    restored = Scheduler.from_records(dict(driver.scheduler.records()), driver.last_facts)
    assert restored.measured == driver.scheduler.measured


@pytest.mark.parametrize("portable", [False, True])
def test_a_moved_job_resumes_on_the_chip_that_wrote_its_checkpoint_unless_portable(
    portable: bool,
) -> None:
    from fleetline.agents.simulator import Fault

    fleet = [
        (ClusterSpec("h100-a", "eu-west", 1), 2.40),
        (ClusterSpec("mi300x-a", "us-east", 1, model="AMD Instinct MI300X"), 2.10),
    ]
    down = Fault("node_down", "mi300x-a-n0000", BASE_MS + 20_000, None)
    view, sim = mixed_fleet_and_simulator(fleet, [down])
    driver = Driver(view, now_ms=NOW_MS)
    document = sized("j", pflop=3.2, steps=2000, checkpoint_interval_s=5)
    document["spec"]["portable"] = portable
    driver.submit(document)
    assert driver.last("acme/j").cluster_id == "mi300x-a"  # the cheaper run
    driver.progress("acme/j", "CHECKPOINT", checkpoint_ms=BASE_MS + 15_000)
    advance(view, sim, 3, 22)
    driver.tick(seconds=12, view=view)
    moved = driver.last("acme/j")
    if portable:
        assert moved.outcome == "PLACED" and moved.cluster_id == "h100-a"
        assert "on 8 h100-80gb-hbm3" in moved.reason
    else:
        assert moved.outcome == "QUEUED"
        assert (
            "h100-a: has no mi300x GPUs (it has nvidia h100-80gb-hbm3 80 GiB) "
            "(its checkpoint was written on mi300x; `portable: true` lets it resume on another "
            "chip)"
        ) in moved.reason


def test_the_heterogeneous_scenario_places_as_its_story_says() -> None:
    """`fleetline run --scenario heterogeneous`'s jobs through the pure scheduler: the file's
    comments stay true."""
    from fleetline.demo import scenario

    story = scenario.load("heterogeneous")
    view = mixed_fleet([(c.spec, c.price_per_gpu_hour or 0.0) for c in story.clusters])
    driver = Driver(view, now_ms=NOW_MS)
    (event,) = [e for e in story.events if e.apply]
    for policy in event.tenant_policies:
        driver.tenant(dict(policy))
    for document in event.apply:
        driver.submit({"apiVersion": "fleetline/v1", **document})
    driver.tick(1)
    where = {key: driver.last(f"acme/{key}").cluster_id for key in ("pretrain", "fp8-finetune")}
    where["int8-distill"] = driver.last("acme/int8-distill").cluster_id
    assert where == {
        "pretrain": "us-east-a",
        "fp8-finetune": "eu-west-a",
        "int8-distill": "ap-south-a",
    }
    pretrain = driver.last("acme/pretrain")
    npu = next(s for s in pretrain.alternatives if s.cluster_id == "ap-south-a")
    assert npu.parts["work"] == 0.5  # the cheapest run, after the deadline
    waiting = driver.last("acme/long-context")
    assert waiting.outcome == "QUEUED" and "us-east-a: needs 1 nodes" in waiting.reason


B200 = {
    "vendor": "nvidia",
    "peak_tflops": {"fp32": 80, "bf16": 2250, "fp8": 4500, "int8": 4500},
    "memory_gb": 180,
    "memory_bandwidth_gbps": 7700,
    "interconnect": {"name": "nvlink", "bandwidth_gbps": 1800},
    "power_w": 1000,
    "efficiency": 0.4,
    "source": "the operator's acceptance run",
}


def test_an_operator_declares_a_model_the_catalogue_lacks_in_a_cluster_document(
    tmp_path,
) -> None:
    from fleetline.processors.scheduling.specs import DOCUMENT_KINDS, SpecError, parse_document
    from fleetline.processors.view import codec as view_codec
    from fleetline.processors.view.catalogue import of_record
    from tests.fake_nvml import hgx_collector, node_agent_offline

    def cluster(accelerators: dict) -> dict:
        return {
            "apiVersion": "fleetline/v1",
            "kind": "Cluster",
            "metadata": {"name": "lab-b"},
            "spec": {"region": "eu-west", "price_per_gpu_hour": 4.0, "accelerators": accelerators},
        }

    declared = parse_document(cluster({"b200": B200}), DOCUMENT_KINDS)
    record = declared.record(1, BASE_MS)  # type: ignore[union-attr]
    assert [m["model"] for m in record["accelerator_models"]] == ["b200"]
    assert of_record(record["accelerator_models"][0]).peak("fp8") == 4500
    with pytest.raises(SpecError, match="b200: power_w is -1; a figure may not be negative"):
        parse_document(cluster({"b200": {**B200, "power_w": -1}}), DOCUMENT_KINDS)

    agent = node_agent_offline(hgx_collector("NVIDIA B200", 180), "b200-host-1", tmp_path, "lab-b")
    node_events = [("NodeState", agent.state(BASE_MS))]
    node_events += [("NodeTelemetry", agent.telemetry(BASE_MS + t * 1000)) for t in (1, 2)]
    undeclared = {**record, "accelerator_models": []}
    job = sized("fp8", pflop=4.0, steps=100, precision="fp8")

    without = Driver(fold([("ClusterInfo", undeclared), *node_events]), now_ms=NOW_MS)
    without.submit(job)
    assert "has no GPUs computing fp8 (it has nvidia b200" in without.last("acme/fp8").reason

    view = fold([("ClusterInfo", record), *node_events])
    with_model = Driver(view, now_ms=NOW_MS)
    with_model.submit(job)
    decision = with_model.last("acme/fp8")
    assert decision.cluster_id == "lab-b"
    assert "on 8 b200 (fp8 4500 TFLOPS x 0.4 of peak)" in decision.reason
    # The view keeps the declaration, in its reads and its snapshots.
    restored = view_codec.from_data(view_codec.to_data(view))
    assert (
        restored.clusters["lab-b"].accelerator_models == view.clusters["lab-b"].accelerator_models
    )


def test_a_cluster_record_declaring_a_bad_model_is_refused_by_the_view() -> None:
    from fleetline.errors import InvalidEventError

    record = cluster_info(ClusterSpec("lab-b", "eu-west", 1), 1, BASE_MS)
    peaks = {"fp32": 80, "bf16": 2250, "int8": 4500}  # fp8 left out
    bad = {
        **B200,
        "model": "b200",
        "peak_tflops": peaks,
        "interconnect": "nvlink",
        "interconnect_gbps": 1800,
    }
    record["accelerator_models"] = [bad]  # type: ignore[typeddict-unknown-key]
    with pytest.raises(InvalidEventError, match="lab-b: accelerator catalogue, b200: peak_tflops"):
        fold([("ClusterInfo", record)])
