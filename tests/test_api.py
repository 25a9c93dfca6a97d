"""The HTTP read API over a folded view: capacity, nodes, GPUs, topology, filters, errors."""

from __future__ import annotations

from fastapi.testclient import TestClient

from fleetline.api.http import StaticView, create_app
from tests.test_view import allocation, fold, scenario_events


def client() -> TestClient:
    view = fold([*scenario_events(seconds=12),
                 allocation("job-a", "ALLOCATED", [("us-east-a-n0003", 0), ("us-east-a-n0003", 1)],
                            1)])
    return TestClient(create_app(StaticView(view)))


def test_openapi_lists_every_route():
    spec = client().get("/openapi.json").json()
    assert set(spec["paths"]) == {
        "/v1/view", "/v1/clusters", "/v1/clusters/{cluster_id}",
        "/v1/clusters/{cluster_id}/topology", "/v1/nodes", "/v1/nodes/{node_id}", "/v1/gpus",
        "/v1/allocations", "/v1/datasets", "/v1/tenants",
    }


def test_cluster_capacity_counts_idle_allocated_degraded_failed():
    api = client()
    body = api.get("/v1/clusters").json()
    clusters = {c["cluster_id"]: c for c in body["items"]}
    assert set(clusters) == {"us-east-a", "eu-west-a", "ap-south-a"}
    us = clusters["us-east-a"]
    assert (us["gpus"], us["allocated"], us["degraded"]) == (32, 2, 16)  # RDMA loss on leaf000
    assert us["idle"] == 32 - 2 - 16
    eu = api.get("/v1/clusters/eu-west-a").json()
    assert (eu["failed"], eu["degraded"]) == (1, 1)
    assert api.get("/v1/clusters", params={"region": "eu-west"}).json()["items"][0][
        "cluster_id"] == "eu-west-a"
    assert api.get("/v1/clusters/nowhere").status_code == 404
    assert body["view_version"] == api.get("/v1/view").json()["version"]


def test_nodes_and_gpus_filter_and_detail():
    api = client()
    down = api.get("/v1/nodes", params={"status": "down"}).json()["items"]
    assert [n["node_id"] for n in down] == ["ap-south-a-n0003"]
    leaf = api.get("/v1/nodes", params={"leaf_switch": "us-east-a-leaf000"}).json()["items"]
    assert [n["node_id"] for n in leaf] == ["us-east-a-n0000", "us-east-a-n0001"]
    labelled = api.get("/v1/nodes", params=[("label", "pool=training"),
                                            ("cluster", "eu-west-a")]).json()["items"]
    assert len(labelled) == 4
    assert api.get("/v1/nodes", params={"label": "nokey"}).status_code == 422
    assert api.get("/v1/nodes", params={"status": "sideways"}).status_code == 422
    node = api.get("/v1/nodes/eu-west-a-n0002").json()
    assert node["gpus"][5]["health"] == "failed" and node["gpus"][5]["cause"] == "xid 79"
    assert api.get("/v1/nodes/ghost").status_code == 404
    failed = api.get("/v1/gpus", params={"health": "failed"}).json()["items"]
    assert [(g["node_id"], g["gpu_index"]) for g in failed] == [("eu-west-a-n0002", 5)]
    allocated = api.get("/v1/gpus", params={"capacity": "allocated"}).json()["items"]
    assert {g["job_id"] for g in allocated} == {"job-a"} and len(allocated) == 2


def test_topology_tenants_and_allocations():
    api = client()
    topo = api.get("/v1/clusters/us-east-a/topology").json()
    (spine,) = topo["spines"]
    assert [leaf["leaf_switch"] for leaf in spine["leaves"]] == ["us-east-a-leaf000",
                                                                 "us-east-a-leaf001"]
    first = spine["leaves"][0]["nodes"][0]
    assert first["nvlink_islands"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert first["degraded_gpus"] == list(range(8))
    assert api.get("/v1/clusters/nowhere/topology").status_code == 404
    assert api.get("/v1/tenants").json()["items"] == [
        {"tenant": "t1", "jobs": 1, "gpus": 2, "by_cluster": {"us-east-a": 2}}]
    assert api.get("/v1/allocations").json()["items"][0]["gpus"] == [
        "us-east-a-n0003/0", "us-east-a-n0003/1"]
