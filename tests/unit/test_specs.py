"""Declarative specs: what parses, and every field-level error a user can get."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from fleetline.processors.scheduling.specs import (
    Dataset,
    InferenceService,
    SpecError,
    TrainingJob,
    parse_size,
    parse_specs,
)

SPECS = Path(__file__).parent.parent / "specs" / "llm-pretrain.yaml"
EXAMPLE = SPECS.read_text()


def test_the_example_parses_into_typed_specs():
    job, dataset, service = parse_specs(EXAMPLE)
    assert isinstance(job, TrainingJob) and job.spec.gpus == 64
    parallelism = job.spec.parallelism
    assert (parallelism.tensor, parallelism.pipeline, parallelism.data) == (8, 4, 2)
    assert (job.spec.min_workers, job.spec.max_workers, job.spec.communication) == (4, 8, "heavy")
    assert job.metadata.labels == {"team": "research"}
    assert isinstance(dataset, Dataset) and dataset.spec.size_bytes == 2 * 2**40
    assert isinstance(service, InferenceService)
    assert (service.spec.min_replicas, service.spec.max_replicas, service.spec.regions) == (
        2,
        8,
        ("eu-west", "us-east"),
    )


def test_data_parallelism_defaults_to_what_tensor_and_pipeline_leave():
    (job,) = parse_specs(
        "kind: TrainingJob\nmetadata: {name: j, tenant: t}\nspec: "
        "{accelerator: H100, gpus_per_worker: 8, workers: 4, "
        "parallelism: {tensor: 8}}"
    )
    assert isinstance(job, TrainingJob) and job.spec.parallelism.data == 4


def test_json_is_accepted_too():
    doc = {
        "kind": "Dataset",
        "metadata": {"name": "d1", "tenant": "acme"},
        "spec": {"size": "500GB", "replicas": []},
    }
    (spec,) = parse_specs(json.dumps(doc))
    assert isinstance(spec, Dataset)
    assert spec.spec.size_bytes == 500 * 10**9 and spec.spec.replicas == ()


def test_every_bad_field_is_named_in_one_go():
    bad = """
kind: TrainingJob
metadata: {name: Bad_Name, tenant: acme}
spec:
  accelerator: H100
  gpus_per_worker: 8
  workers: 0
  parallelism: {tensor: 3, pipeline: 1, data: 1}
  comunication: heavy
  priority_class: urgent
  elastic: {min_workers: 2, max_workers: 1}
"""
    with pytest.raises(SpecError) as caught:
        parse_specs(bad)
    paths = {e.path: e.message for e in caught.value.errors}
    assert "metadata.name" in paths and "lower-case" in paths["metadata.name"]
    assert paths["spec.workers"] == "must be >= 1, got 0"
    assert paths["spec.comunication"] == "unknown field (did you mean communication?)"
    assert "urgent" in paths["spec.priority_class"]
    assert "tensor x pipeline x data is 3" in paths["spec.parallelism"]
    assert "NVLink" in paths["spec.parallelism.tensor"]
    assert "spec.elastic" in paths


@pytest.mark.parametrize(
    "text, path, message",
    [
        ("kind: Pod", "kind", "must be one of"),
        ("[1, 2]", "(document)", "must be a mapping"),
        (
            "kind: Dataset\nmetadata: {name: d}\nspec: {size: lots}",
            "spec.size",
            "like 500GB or 2TiB, got 'lots'",
        ),
        (
            "kind: Dataset\nmetadata: {name: Big_Data, tenant: t}\nspec: {size: 1}",
            "metadata.name",
            "starting and ending with a letter or digit; got 'Big_Data'",
        ),
        (
            "kind: TrainingJob\nmetadata: {name: j, tenant: t}\n"
            "spec: {accelerator: H100, gpus_per_worker: 1, workers: 1, max_runtime: soon}",
            "spec.max_runtime",
            "like 90m, 24h, 2d, got 'soon'",
        ),
        ("kind: Dataset\nmetadata: {name: d}\nspec: {size: 1}", "metadata.tenant", "is required"),
        (
            "kind: InferenceService\nmetadata: {name: s, tenant: t}\n"
            "spec: {model: m, accelerator: a, replicas: {min: 3, max: 2},"
            " latency_target_ms: 100, regions: [eu]}",
            "spec.replicas",
            "min 3 is above max 2",
        ),
        (
            "kind: InferenceService\nmetadata: {name: s, tenant: t}\n"
            "spec: {model: m, accelerator: a, latency_target_ms: -5, regions: []}",
            "spec.latency_target_ms",
            "positive number",
        ),
        (
            "apiVersion: v9\nkind: Dataset\nmetadata: {name: d, tenant: t}\nspec: {size: 1}",
            "apiVersion",
            "fleetline/v1",
        ),
        ("key: [unclosed", "(text)", "not YAML or JSON"),
        (
            "kind: Dataset\nmetadata: {name: d, tenant: t}\n"
            "spec: {size: 1, sensitivity: restricted}",
            "spec.residency",
            "a restricted dataset must name the regions its data stays in",
        ),
        (
            "kind: Dataset\nmetadata: {name: d, tenant: t}\n"
            "spec: {size: 1, source: 's3://corpora/web'}",
            "spec.source",
            "must be a key prefix in each replica cluster's store",
        ),
        (
            "kind: Dataset\nmetadata: {name: d, tenant: t}\nspec: {size: 1, source: a/../b/}",
            "spec.source",
            "no empty, . or .. part",
        ),
    ],
)
def test_specific_errors(text, path, message):
    with pytest.raises(SpecError) as caught:
        parse_specs(text)
    assert any(e.path == path and message in e.message for e in caught.value.errors), (
        caught.value.errors
    )


def test_errors_in_a_multi_document_file_name_their_document():
    text = EXAMPLE + "\n---\nkind: Dataset\nmetadata: {name: x, tenant: acme}\nspec: {size: -1}"
    with pytest.raises(SpecError, match=r"document 4: spec\.size"):
        parse_specs(text)


def test_sizes():
    assert parse_size("1.5 GiB") == int(1.5 * 2**30)
    assert parse_size(42) == 42
    assert parse_size("12 parsecs") is None and parse_size(True) is None


def test_the_validate_command(capsys, tmp_path):
    from fleetline.cli import main

    assert main(["validate", "-f", str(SPECS)]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "TrainingJob acme/llm-pretrain: valid",
        "Dataset acme/web-corpus: valid",
        "InferenceService acme/chat: valid",
    ]
    bad = tmp_path / "bad.yaml"
    bad.write_text("kind: Dataset\nmetadata: {name: d, tenant: t}\nspec: {size: huge}\n")
    assert main(["validate", "-f", str(bad)]) == 1
    assert "spec.size: must be bytes" in capsys.readouterr().err


def test_cluster_documents_declare_what_the_view_folds():
    from fleetline.processors.scheduling.specs import (
        DOCUMENT_KINDS,
        Cluster,
        parse_documents,
        parse_spec,
    )

    text = (Path(__file__).parent.parent / "specs" / "clusters.yaml").read_text()
    eu, us = parse_documents(text, DOCUMENT_KINDS)
    assert isinstance(eu, Cluster) and isinstance(us, Cluster)
    record = eu.record(seq=7, ts_ms=1000)
    assert record["kind"] == "ON_PREMISES" and record["pue"] == 1.25
    assert record["link_latency_ms"] == {"eu-west": 0.5, "us-east": 75.0, "ap-south": 120.0}
    assert us.record(7, 1000)["kind"] == "CLOUD"
    bad = (
        "kind: Cluster\nmetadata: {name: EU_West}\n"
        "spec: {region: eu-west, kind: colo, pue: 0.9, price_per_gpu_hour: -1, latency_ms: {}}\n"
    )
    with pytest.raises(SpecError) as refused:
        parse_documents(bad, DOCUMENT_KINDS)
    assert {e.path: e.message for e in refused.value.errors} == {
        "metadata.name": "must be a DNS-style label, like eu-west-a; got 'EU_West'",
        "spec.kind": "must be one of 'on-premises' or 'cloud', got 'colo'",
        "spec.pue": "must be >= 1.0, got 0.9",
        "spec.price_per_gpu_hour": "must be >= 0.0, got -1",
        "spec.latency_ms": "unknown field (did you mean link_latency_ms?)",
    }
    # The scheduler places jobs and datasets; a cluster is not something it takes.
    with pytest.raises(SpecError, match="kind: must be one of TrainingJob, InferenceService"):
        parse_spec(yaml.safe_load(text.split("---")[0]))


def test_a_quota_size_names_the_value_it_refuses():
    from fleetline.errors import FleetlineError
    from fleetline.processors.scheduling.tenancy import TenantPolicy

    with pytest.raises(FleetlineError, match=r"is not a size .*, got 'lots'"):
        TenantPolicy.from_data({"tenant": "acme", "quota": {"storage_bytes": "lots"}})
