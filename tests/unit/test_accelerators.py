"""What a node's GPUs are, from the hardware to a placement: the NVML agent's NodeState (the fake
NVML at the library boundary), the view's node facts, spec matching by model, family or memory,
and the reasons a person reads when nothing matches."""

from __future__ import annotations

from pathlib import Path

import pytest

from fleetline.agents.devices.nvml import NvmlDevices, RdmaCounters
from fleetline.agents.node import NodeAgent, operator_labels
from fleetline.agents.simulator import ClusterSpec, FleetSimulator, cluster_info
from fleetline.errors import ConfigError
from fleetline.processors.scheduling.capacity import CapacityIndex, observe
from fleetline.processors.scheduling.pipeline import Context, JobRequest, rank_clusters
from fleetline.processors.scheduling.placement import Placement, training_shape
from fleetline.processors.scheduling.policy import SchedulingPolicy
from fleetline.processors.scheduling.specs import SpecError, TrainingJobSpec, parse_spec
from fleetline.processors.view import codec as view_codec
from fleetline.processors.view.accelerators import (
    Accelerator,
    suits,
    wanted,
)
from fleetline.processors.view.read import node_data
from fleetline.processors.view.summary import capacity_of, capacity_record, node_capacity
from fleetline.streams.serde import default_codec
from tests.fake_nvml import FakeNvml, hgx_collector, hgx_gpu, node_agent_offline
from tests.fleet_events import fold
from tests.scheduling_support import place_training, training
from tests.support import BASE_MS

CODEC = default_codec()
A100 = "NVIDIA A100-SXM4-40GB"
A100_MIB = 40960  # what NVML reports for an A100 40GB


@pytest.mark.parametrize(
    ("device", "model", "family"),
    [
        ("NVIDIA H100 80GB HBM3", "h100-80gb-hbm3", "h100"),
        ("NVIDIA A100-SXM4-40GB", "a100-sxm4-40gb", "a100"),
        ("Tesla V100-SXM2-16GB", "v100-sxm2-16gb", "v100"),
        ("NVIDIA GeForce RTX 4090", "rtx-4090", "rtx"),
        ("AMD Instinct MI300X", "mi300x", "mi300x"),
        ("NVIDIA H200", "h200", "h200"),
        ("  h100  ", "h100", "h100"),
    ],
)
def test_device_names_normalise_to_a_model_and_its_family(device, model, family) -> None:
    accelerator = Accelerator.of_device("NVIDIA", device, 81559)
    assert (accelerator.vendor, accelerator.model, accelerator.family) == ("nvidia", model, family)
    assert accelerator.name == device


def test_a_spec_matches_a_model_or_family_exactly_never_a_substring() -> None:
    h100 = Accelerator.of_device("nvidia", "NVIDIA H100 80GB HBM3", 81559)
    a100x = Accelerator.of_device("nvidia", "NVIDIA A100X", 81920)
    assert suits(h100, wanted("H100")) and suits(h100, wanted(["h100-80GB-HBM3"]))
    assert suits(h100, ()), "no accelerator named: any model"
    assert not suits(h100, wanted("H10")) and not suits(h100, wanted("100"))
    assert not suits(a100x, wanted("A100")), "a100x is its own family"
    assert suits(h100, wanted(["A100", "H100"]))
    # Memory counts in GB as vendors name it: an 80GB part has 80 GB, not 80 GiB.
    assert suits(h100, (), min_memory_mib=training_spec(min_gpu_memory_gb=80).min_gpu_memory_mib)
    assert not suits(h100, (), training_spec(min_gpu_memory_gb=90).min_gpu_memory_mib)


def training_spec(workers: int = 1, **spec) -> TrainingJobSpec:
    doc = training("j", workers=workers, **{"accelerator": None, **spec})
    parsed = parse_spec(doc).spec
    assert isinstance(parsed, TrainingJobSpec)
    return parsed


def test_accelerator_is_optional_and_may_be_a_list() -> None:
    assert training_spec().accelerators == ()
    assert training_spec(accelerator=["H200", "h100"]).accelerators == ("h100", "h200")
    assert training_spec(accelerator="NVIDIA H100 80GB HBM3").accelerators == ("h100-80gb-hbm3",)
    for bad, message in (
        ([], "an empty list"),
        ("---", "is not a model name"),
        (["H100", 7], "spec.accelerator"),
    ):
        with pytest.raises(SpecError, match=message):
            training_spec(accelerator=bad)
    with pytest.raises(SpecError, match="min_gpu_memory_gb"):
        training_spec(min_gpu_memory_gb=0)


# -- the NVML agent's NodeState ------------------------------------------------------------------


def nvml_agent(
    tmp_path: Path, node_id: str, device: str = "NVIDIA H100 80GB HBM3", memory_gib: int = 80
) -> NodeAgent:
    return node_agent_offline(
        hgx_collector(device, memory_gib),
        node_id,
        tmp_path,
        leaf_switch="lab-a-leaf0",
        spine_switch="lab-a-spine0",
        labels=operator_labels({"pool": "training", "rack": "r7"}),
    )


def test_the_nvml_agent_states_what_its_gpus_are(tmp_path: Path) -> None:
    agent = nvml_agent(tmp_path, "gpu-host-1")
    record = agent.state(BASE_MS)
    # Exactly what goes on the topic: the newest NodeState schema takes it as it is.
    decoded = CODEC.decode(CODEC.encode("NodeState", record))
    assert decoded.record["accelerator"] == {
        "vendor": "nvidia",
        "model": "h100-80gb-hbm3",
        "name": "NVIDIA H100 80GB HBM3",
        "memory_mib": 80 * 1024,
    }
    assert decoded.record["labels"] == {"pool": "training", "rack": "r7", "cordoned": "false"}
    assert "accelerator" not in decoded.record["labels"]
    topology = decoded.record["topology"]
    assert (topology["spine_switch"], topology["nvlink_islands"]) == (
        "lab-a-spine0",
        [[0, 1, 2, 3], [4, 5, 6, 7]],
    )


def test_a_node_of_mixed_gpus_is_scheduled_as_its_weakest(tmp_path: Path) -> None:
    gpus = [hgx_gpu(0), hgx_gpu(1, name=b"NVIDIA H100 PCIe", memory=(0, 40 * 2**30))]
    collector = NvmlDevices(nvml=FakeNvml(gpus), rdma=RdmaCounters(Path("/nonexistent"))).open()
    assert collector.accelerator() == Accelerator("nvidia", "h100-80gb-hbm3", 40 * 1024)


@pytest.mark.parametrize(
    ("labels", "message"),
    [
        ({"accelerator": "H100"}, "reads the GPUs' model from the driver"),
        ({"cordoned": "true"}, "from the commands it applied"),
        ({"-bad": "x"}, "a key is letters"),
    ],
)
def test_labels_the_agent_owns_or_that_are_not_labels_are_refused(labels, message) -> None:
    with pytest.raises(ConfigError, match=message):
        operator_labels(labels)


def nvml_fleet(tmp_path: Path) -> tuple:
    """A view of two NVML-shaped nodes (H100 80GB, A100 40GB) in one cluster, a few samples
    each, and the simulated H200 cluster beside them."""
    h100 = nvml_agent(tmp_path, "gpu-host-1")
    a100 = nvml_agent(tmp_path, "gpu-host-2", device=A100, memory_gib=40)
    sim = FleetSimulator([ClusterSpec("ap-south-a", "ap-south", 1, model="NVIDIA H200")], seed=3)
    lab = ClusterSpec("lab-a", "eu-west", 2)
    events: list[tuple[str, dict]] = [
        ("ClusterInfo", cluster_info(lab, 1, BASE_MS)),
        ("ClusterInfo", cluster_info(sim.clusters[0], 1, BASE_MS)),
        ("NodeState", h100.state(BASE_MS)),
        ("NodeState", a100.state(BASE_MS)),
        *(("NodeState", r) for r in sim.initial_states(BASE_MS)),
    ]
    for t in range(1, 3):
        ts = BASE_MS + t * 1000
        events += [("NodeTelemetry", h100.telemetry(ts)), ("NodeTelemetry", a100.telemetry(ts))]
        events += [("NodeTelemetry", r) for r in sim.telemetry(ts)]
    return fold(events)


def test_the_view_keeps_model_vendor_and_memory_as_node_facts(tmp_path: Path) -> None:
    view = nvml_fleet(tmp_path)
    node = view.nodes["gpu-host-2"]
    assert node.accelerator == Accelerator("nvidia", "a100-sxm4-40gb", 40 * 1024)
    assert node_data(view, node, with_gpus=False)["accelerator"] == {
        "vendor": "nvidia",
        "model": "a100-sxm4-40gb",
        "family": "a100",
        "name": A100,
        "memory_mib": 40 * 1024,
    }
    # The simulator states its GPUs the same way.
    assert view.nodes["ap-south-a-n0000"].accelerator == Accelerator("nvidia", "h200", 143771)
    # A snapshot keeps them; the summary a sharded scheduler reads keeps all it compares.
    assert view_codec.decode(view_codec.encode(view)[0]).nodes["gpu-host-2"].accelerator == (
        node.accelerator
    )
    capacity = node_capacity(node, node.state)
    assert capacity_of("lab-a", capacity_record(capacity)) == capacity


def test_a_node_state_from_before_v3_reads_its_label(tmp_path: Path) -> None:
    record = nvml_agent(tmp_path, "old").state(BASE_MS)
    del record["accelerator"]
    record["labels"]["accelerator"] = "NVIDIA H100 80GB HBM3"
    view = fold([("NodeState", record)])
    assert view.nodes["old"].accelerator.names == {"h100-80gb-hbm3", "h100"}


def rank(view, **spec) -> dict:
    job = training_spec(**spec)
    request = JobRequest("acme/j", "acme", training_shape(job), 2)
    ranked = rank_clusters(
        Context(CapacityIndex(observe(view)), SchedulingPolicy(), {}, {}, request)
    )
    return {s.cluster_id: s.rejected for s in ranked}


def test_placement_honours_model_list_and_memory(tmp_path: Path) -> None:
    view = nvml_fleet(tmp_path)
    # No model named: any node, the A100 as well as the H100.
    anywhere = place_training(view, "lab-a", training_spec())
    assert isinstance(anywhere, Placement)
    # A gang never mixes kinds of chip: two workers do not take the H100 and the A100.
    two = place_training(view, "lab-a", training_spec(workers=2))
    assert not isinstance(two, Placement)
    assert two.reason == (
        "needs 2 nodes of one kind of chip with 8 free GPUs; of those that fit, "
        "1 a100-sxm4-40gb, 1 h100-80gb-hbm3"
    )
    # 48 GB rules the A100 out in the lab and leaves the H200 cluster in.
    big = place_training(view, "lab-a", training_spec(min_gpu_memory_gb=48))
    assert isinstance(big, Placement) and {n for n, _ in big.gpus} == {"gpu-host-1"}
    assert rank(view, min_gpu_memory_gb=48)["ap-south-a"] is None
    assert rank(view, accelerator=["a100", "h200"]) == {"lab-a": None, "ap-south-a": None}


def test_what_nothing_in_the_fleet_has_waits_with_the_reason(tmp_path: Path) -> None:
    view = nvml_fleet(tmp_path)
    too_big = rank(view, min_gpu_memory_gb=200)
    assert too_big["lab-a"] == (
        "has no GPUs with 200+ GB "
        "(it has nvidia a100-sxm4-40gb 40 GiB and nvidia h100-80gb-hbm3 80 GiB)"
    )
    assert too_big["ap-south-a"] == "has no GPUs with 200+ GB (it has nvidia h200 140 GiB)"
    typo = rank(view, accelerator="H1000")
    assert typo["lab-a"].endswith("(did you mean h100?)"), typo
    # A model another cluster has is no typo.
    assert "did you mean" not in rank(view, accelerator="H200")["lab-a"]


@pytest.mark.parametrize(
    ("flag", "message"),
    [
        ("pool", "--label takes KEY=VALUE, got 'pool'"),
        ("accelerator=H100", "'accelerator' is not the operator's to set"),
    ],
)
def test_the_nvml_agent_refuses_a_bad_label_before_it_opens_anything(flag, message, capsys) -> None:
    from fleetline.cli import main

    assert main(["agent", "nvml", "--label", flag]) == 1
    err = capsys.readouterr().err
    assert err.startswith("fleetline: error: ") and message in err, err
    assert len(err.strip().splitlines()) == 1
