"""The data plane's pure parts and its channel: how a step is cut into gradient shards and
summed, a job's world across clusters, the sealed channel between leaders, a worker's place as
its launcher gives it, and a split job's order as each cluster's agent reads it."""

from __future__ import annotations

import json
import socket

import numpy as np
import pytest

from fleetline.agents.cluster.rank import worker_env
from fleetline.agents.cluster.reconcile import Order
from fleetline.agents.dataplane.channel import DataPlaneError, SealedChannel, run_key
from fleetline.agents.dataplane.collective import pack_state, unpack_state
from fleetline.agents.dataplane.shards import (
    GRADIENT_SHARDS,
    Part,
    World,
    ordered_sum,
    shard_samples,
    shards_of,
)
from fleetline.agents.workloads import train


def test_every_world_size_cuts_the_batch_into_the_same_shards_each_computed_once():
    assert shard_samples(64) == [(i * 8, i * 8 + 8) for i in range(8)]
    assert shard_samples(10, 4) == [(0, 3), (3, 6), (6, 8), (8, 10)]
    for world in range(1, GRADIENT_SHARDS + 1):
        computed = [i for rank in range(world) for i in shards_of(rank, world)]
        assert computed == list(range(GRADIENT_SHARDS)), world
    with pytest.raises(ValueError, match="from 1 to 8"):
        shards_of(0, 9)
    with pytest.raises(ValueError, match="cannot be cut"):
        shard_samples(4)


def test_one_process_and_any_split_of_the_shards_take_bit_identical_steps():
    config = train.TrainConfig(steps=5)
    x, y = train.data(config)
    alone, opt_alone, rng_alone = train.initial(config)
    for _ in range(5):
        train.train_step(config, alone, opt_alone, rng_alone, x, y)
    for world in (2, 3, 8):
        params, optimizer, rng = train.initial(config)
        for _ in range(5):
            index = train.batch_index(config, rng)
            shards: dict[int, np.ndarray] = {}
            for rank in range(world):  # each rank its own shards, summed in shard order
                shards |= train.my_shard_gradients(
                    config, params, index, x, y, shards_of(rank, world)
                )
            total = ordered_sum([shards[i] for i in range(GRADIENT_SHARDS)])
            train.apply_gradient(config, params, optimizer, total)
        for name in alone:
            assert np.array_equal(params[name], alone[name]), (world, name)


def test_a_world_s_parts_follow_each_other_from_rank_0():
    world = World((Part("ca", 0, 1), Part("cc", 1, 2)))
    assert World.from_json(world.to_json()) == world
    assert (world.size, world.root.cluster_id) == (3, "ca")
    assert world.shards_of_part(world.part("cc")) == range(2, 8)
    with pytest.raises(ValueError, match="starts at 2, expected 1"):
        World.from_json('[{"cluster_id": "ca", "first_rank": 0, "workers": 1},'
                        ' {"cluster_id": "cb", "first_rank": 2, "workers": 1}]')  # fmt: skip
    with pytest.raises(ValueError, match="not a list of parts"):
        World.from_json('{"parts": 1}')


def test_a_training_state_travels_whole():
    parts = {"params.npz": b"\x00\x01", "state.json": b'{"step": 3}', "empty": b""}
    assert unpack_state(pack_state(parts)) == parts


def _pair(key_a: bytes, key_b: bytes) -> tuple[SealedChannel, SealedChannel]:
    left, right = socket.socketpair()
    left.settimeout(5)
    right.settimeout(5)
    return SealedChannel(left, key_a, 0, 1), SealedChannel(right, key_b, 1, 0)


def test_the_leaders_channel_opens_only_under_the_run_s_key_and_in_order():
    tenant = bytes(range(32))
    key = run_key(tenant, "acme/j", 3, 1)
    root, member = _pair(key, key)
    member.send("shards", b"gradients")
    assert root.recv("shards") == b"gradients"
    root.send("sum", b"total")
    with pytest.raises(DataPlaneError, match="does not open"):
        member.recv("shards")  # a sum passed off as another kind
    # A fenced attempt's peer holds the previous attempt's key: refused.
    stale = run_key(tenant, "acme/j", 3, 0)
    assert stale != key
    root, member = _pair(key, stale)
    member.send("hello", b"{}")
    with pytest.raises(DataPlaneError, match="does not open under this run's key"):
        root.recv("hello")
    # A message sent again (or out of order) is refused by its counter.
    root, member = _pair(key, key)
    member.send("shards", b"one")
    member._sent = 0
    member.send("shards", b"again")
    assert root.recv("shards") == b"one"
    with pytest.raises(DataPlaneError, match="message 0 where 1 was due"):
        root.recv("shards")


def test_a_silent_or_closed_peer_is_an_error_naming_what_was_awaited():
    key = bytes(32)
    root, member = _pair(key, key)
    root.sock.settimeout(0.2)
    with pytest.raises(DataPlaneError, match="waiting for a shards from part 1"):
        root.recv("shards")
    member.close()
    with pytest.raises(DataPlaneError, match="closed the channel"):
        root.recv("shards")


def test_a_worker_learns_its_ranks_gpus_and_progress_file_from_its_launcher():
    env = {
        "OMPI_COMM_WORLD_RANK": "1",
        "FLEETLINE_RANK_BASE": "4",
        "FLEETLINE_WORKERS": '[{"rank": 4, "node_id": "n0", "gpus": [0, 1]},'
        ' {"rank": 5, "node_id": "n1", "gpus": [2, 3]}]',
        "FLEETLINE_PROGRESS_FILE": "/run/progress.jsonl",
    }
    worker = worker_env(env)
    assert (worker["FLEETLINE_LOCAL_RANK"], worker["FLEETLINE_RANK"]) == ("1", "5")
    assert worker["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert worker["FLEETLINE_PROGRESS_FILE"] == "/run/progress.jsonl.rank1"
    # Slurm binds the GPUs itself; rank 0 keeps the file the agent reads.
    slurm = worker_env({"SLURM_PROCID": "0", "CUDA_VISIBLE_DEVICES": "7", **env} | {
        "OMPI_COMM_WORLD_RANK": ""})  # fmt: skip
    assert (slurm["FLEETLINE_RANK"], slurm["CUDA_VISIBLE_DEVICES"]) == ("4", "7")
    assert slurm["FLEETLINE_PROGRESS_FILE"] == "/run/progress.jsonl"


def _split_order() -> Order:
    record = {
        "job": "acme/j", "tenant": "acme", "kind": "TrainingJob", "action": "RUN",
        "cluster_id": "ca", "epoch": 2, "attempt": 1, "ts": 1, "reason": "", "trace_id": "t",
        "spec_json": None, "workers": [{"node_id": "ca-n0", "gpus": [0]}], "resume_from": [],
        "resume_step": None, "final_checkpoint": False,
        "parts": [
            {"cluster_id": "ca", "first_rank": 0, "workers": [{"node_id": "ca-n0", "gpus": [0]}]},
            {"cluster_id": "cc", "first_rank": 1, "workers": [
                {"node_id": "cc-n0", "gpus": [0]}, {"node_id": "cc-n1", "gpus": [1]}]},
        ],
    }  # fmt: skip
    return Order.from_record(record)


def test_a_split_job_s_order_is_each_part_s_own_run_in_its_cluster():
    order = _split_order()
    assert order.seen_from("ca") == order
    assert (order.first_rank, order.world_size) == (0, 3)
    cc = order.seen_from("cc")
    assert cc.cluster_id == "cc" and cc.run_id == order.run_id
    assert cc.workers == (("cc-n0", (0,)), ("cc-n1", (1,)))
    assert (cc.first_rank, cc.world_size) == (1, 3)
    # A cluster holding no part sees the order as one for another cluster: it runs nothing.
    assert order.seen_from("cb").cluster_id == "ca"


def test_the_dataplane_scenario_s_job_fits_no_cluster_alone_and_two_together() -> None:
    from fleetline.demo import scenario

    story = scenario.load("dataplane")
    assert story.split_job == "acme/split"
    (job,) = [d for e in story.events for d in e.apply if d["metadata"]["name"] == "split"]
    spec = job["spec"]
    gpus = spec["workers"] * spec["gpus_per_worker"]
    per_cluster = [c.spec.nodes * 8 for c in story.clusters]
    assert spec["allow_split_across_clusters"] is True
    assert all(held < gpus for held in per_cluster) and sum(per_cluster) >= gpus


def test_the_dataplane_scenario_s_prewarm_needs_its_data_copied_and_bad_plans_are_refused() -> None:
    from fleetline.demo import scenario
    from fleetline.errors import ConfigError

    story = scenario.load("dataplane")
    plan = story.prewarm
    assert plan is not None
    (job,) = [d for d in plan["apply"] if d["kind"] == "TrainingJob"]
    (data,) = [d for d in plan["apply"] if d["kind"] == "Dataset"]
    # The data's cluster cannot run the job (another GPU model): the data must move.
    holder = next(c for c in story.clusters if c.spec.cluster_id == plan["cluster"])
    assert data["spec"]["replicas"] == [plan["cluster"]]
    assert job["spec"]["accelerator"].lower() not in holder.spec.model.lower()
    raw = {
        "name": "x",
        "clusters": [{"id": "a", "region": "r", "nodes": 1}],
        "prewarm": {"cluster": "b", "objects": 1, "object_mib": 1, "apply": []},
    }
    with pytest.raises(ConfigError, match=r"prewarm\.cluster: 'b' is not a scenario cluster"):
        scenario.parse(raw)
    raw["prewarm"] |= {"cluster": "a", "objects": 0}
    with pytest.raises(ConfigError, match=r"prewarm\.objects: a positive whole number"):
        scenario.parse(raw)


def test_masking_hashes_the_sensitive_fields_of_every_record_under_the_tenant_s_key() -> None:
    from fleetline.agents.dataplane.prewarm import CopyError, Mask, mask_key

    records = (
        b'{"patient": "p-17", "age": 61, "note": "x"}\n\n'
        b'{"patient": "p-17", "age": 44}\n{"note": "no patient"}\n'
    )
    key = mask_key(b"k" * 32, "acme")
    masked = Mask(("patient", "age"), key).apply("d/a.jsonl", records)
    lines = [json.loads(line) for line in masked.decode().splitlines()]
    assert b"p-17" not in masked and all(not isinstance(r.get("age"), int) for r in lines)
    # The same value hashes the same (joins and counts still work); other fields untouched.
    assert lines[0]["patient"] == lines[1]["patient"] != lines[0]["age"]
    assert lines[0]["patient"].startswith("masked:") and lines[0]["note"] == "x"
    assert lines[2] == {"note": "no patient"}
    # Another tenant's key, another hash: a guess cannot be tested without the key.
    other = Mask(("patient",), mask_key(b"k" * 32, "globex")).apply("d/a.jsonl", records)
    assert json.loads(other.splitlines()[0])["patient"] != lines[0]["patient"]
    # What cannot be masked is not copied out of its region.
    with pytest.raises(CopyError, match=r"d/b\.bin: its sensitive fields cannot be masked"):
        Mask(("patient",), key).apply("d/b.bin", b"\xff\xfe binary")
    with pytest.raises(CopyError, match="line 2 is not JSON"):
        Mask(("patient",), key).apply("d/c.jsonl", b'{"a": 1}\nnot json\n')
