"""Declarative specs: TrainingJob, InferenceService and Dataset, from YAML or JSON.

`parse_specs(text)` reads one or more documents and returns typed specs, or raises SpecError
listing every problem with its field path (`spec.parallelism: tensor x pipeline x data is 16,
the job has 32 GPUs`), so a user fixes a spec in one round. Unknown fields are errors (a typo
must not silently fall back to a default), with the nearest known name suggested.

This is the first piece of the scheduling issue: what users submit. The desired-state events,
the reconcile loop and placement build on these types.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml

from fleetline.errors import FleetlineError

API_VERSION = "fleetline/v1"
PRIORITY_CLASSES = ("critical", "high", "normal", "low", "best-effort")
COMMUNICATION = ("heavy", "moderate", "light")
_NAME = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
_SIZE = re.compile(r"^\s*(?P<n>\d+(\.\d+)?)\s*(?P<unit>[KMGTP]i?B|B)?\s*$")
_UNITS = {None: 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "PB": 10**15,
          "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40, "PiB": 2**50}


@dataclass(frozen=True)
class FieldError:
    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"


class SpecError(FleetlineError):
    """A spec that does not validate; `errors` names every bad field."""

    def __init__(self, errors: list[FieldError]) -> None:
        self.errors = errors
        super().__init__("; ".join(str(e) for e in errors))


@dataclass(frozen=True)
class Metadata:
    name: str
    tenant: str
    labels: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Parallelism:
    tensor: int
    pipeline: int
    data: int


@dataclass(frozen=True)
class TrainingJob:
    metadata: Metadata
    accelerator: str
    gpus_per_worker: int
    workers: int
    parallelism: Parallelism
    communication: str
    priority_class: str
    checkpoint_interval_s: int
    dataset: str | None
    min_workers: int
    max_workers: int
    allow_split_across_clusters: bool
    max_runtime_s: int | None = None  # None: the scheduling policy's default
    region: str | None = None  # where its users or upstream data sit, for the latency score
    kind: str = "TrainingJob"

    @property
    def gpus(self) -> int:
        return self.gpus_per_worker * self.workers


@dataclass(frozen=True)
class InferenceService:
    metadata: Metadata
    model: str
    accelerator: str
    gpus_per_replica: int
    min_replicas: int
    max_replicas: int
    latency_target_ms: float
    regions: tuple[str, ...]
    priority_class: str
    kind: str = "InferenceService"


@dataclass(frozen=True)
class Dataset:
    metadata: Metadata
    size_bytes: int
    replicas: tuple[str, ...]
    source: str | None
    kind: str = "Dataset"


Spec = TrainingJob | InferenceService | Dataset


class _Reader:
    """Walks one document, collecting errors instead of stopping at the first."""

    def __init__(self) -> None:
        self.errors: list[FieldError] = []

    def fail(self, path: str, message: str) -> None:
        self.errors.append(FieldError(path, message))

    def mapping(self, value: Any, path: str, known: tuple[str, ...]) -> Mapping[str, Any]:
        if value is None:
            return {}
        if not isinstance(value, Mapping):
            self.fail(path, f"must be a mapping, got {type(value).__name__}")
            return {}
        for key in value:
            if key not in known:
                near = difflib.get_close_matches(str(key), known, n=1)
                hint = f" (did you mean {near[0]}?)" if near else ""
                self.fail(f"{path}.{key}", f"unknown field{hint}")
        return value

    def integer(self, m: Mapping[str, Any], key: str, path: str, *, default: int | None = None,
                minimum: int = 1) -> int:
        value = m.get(key, default)
        if value is None:
            self.fail(f"{path}.{key}", "is required")
            return minimum
        if isinstance(value, bool) or not isinstance(value, int):
            self.fail(f"{path}.{key}", f"must be an integer, got {value!r}")
            return minimum
        if value < minimum:
            self.fail(f"{path}.{key}", f"must be >= {minimum}, got {value}")
            return minimum
        return value

    def text(self, m: Mapping[str, Any], key: str, path: str, *, default: str | None = None,
             choices: tuple[str, ...] | None = None, required: bool = True) -> str | None:
        value = m.get(key, default)
        if value is None:
            if required:
                self.fail(f"{path}.{key}", "is required")
            return None
        if not isinstance(value, str) or not value.strip():
            self.fail(f"{path}.{key}", f"must be a non-empty string, got {value!r}")
            return None
        if choices is not None and value not in choices:
            self.fail(f"{path}.{key}", f"must be one of {', '.join(choices)}, got {value!r}")
            return None
        return value

    def names(self, m: Mapping[str, Any], key: str, path: str) -> tuple[str, ...]:
        value = m.get(key, [])
        if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
            self.fail(f"{path}.{key}", "must be a list of names")
            return ()
        if len(set(value)) != len(value):
            self.fail(f"{path}.{key}", "names a cluster or region twice")
        return tuple(value)


def parse_size(text: Any) -> int | None:
    """Bytes from 123, "500GB", "2TiB"; None if it is not a size."""
    if isinstance(text, bool):
        return None
    if isinstance(text, int):
        return text if text >= 0 else None
    match = _SIZE.match(str(text))
    if match is None:
        return None
    return int(float(match["n"]) * _UNITS[match["unit"]])


def _metadata(r: _Reader, value: Any) -> Metadata:
    m = r.mapping(value, "metadata", ("name", "tenant", "labels"))
    name = r.text(m, "name", "metadata") or "invalid"
    if name != "invalid" and not _NAME.match(name):
        r.fail("metadata.name", "must be lower-case letters, digits and '-', at most 63, "
               f"starting and ending with a letter or digit; got {name!r}")
    tenant = r.text(m, "tenant", "metadata") or "invalid"
    if tenant != "invalid" and not _NAME.match(tenant):
        r.fail("metadata.tenant", f"must be a DNS-style label, got {tenant!r}")
    labels = m.get("labels", {}) or {}
    if not isinstance(labels, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in labels.items()):
        r.fail("metadata.labels", "must map strings to strings")
        labels = {}
    return Metadata(name, tenant, dict(labels))


_TRAINING = ("accelerator", "gpus_per_worker", "workers", "parallelism", "communication",
             "priority_class", "checkpoint_interval_s", "dataset", "elastic",
             "allow_split_across_clusters", "max_runtime", "region")
_DURATION = re.compile(r"^\s*(?P<n>\d+(\.\d+)?)\s*(?P<unit>s|m|h|d)?\s*$")
_SECONDS = {None: 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: Any) -> int | None:
    """Seconds from 3600, "90m", "24h", "2d"; None if it is not a duration."""
    if isinstance(text, bool):
        return None
    if isinstance(text, int):
        return text if text > 0 else None
    match = _DURATION.match(str(text))
    if match is None:
        return None
    seconds = int(float(match["n"]) * _SECONDS[match["unit"]])
    return seconds if seconds > 0 else None


def _training(r: _Reader, meta: Metadata, value: Any) -> TrainingJob:
    s = r.mapping(value, "spec", _TRAINING)
    accelerator = r.text(s, "accelerator", "spec") or ""
    per_worker = r.integer(s, "gpus_per_worker", "spec")
    workers = r.integer(s, "workers", "spec")
    p = r.mapping(s.get("parallelism"), "spec.parallelism", ("tensor", "pipeline", "data"))
    tensor = r.integer(p, "tensor", "spec.parallelism", default=1)
    pipeline = r.integer(p, "pipeline", "spec.parallelism", default=1)
    data = r.integer(p, "data", "spec.parallelism",
                     default=max(1, (per_worker * workers) // max(1, tensor * pipeline)))
    total = per_worker * workers
    if tensor * pipeline * data != total:
        r.fail("spec.parallelism", f"tensor x pipeline x data is {tensor * pipeline * data}, "
               f"the job has {total} GPUs ({workers} workers x {per_worker})")
    if per_worker % tensor and tensor % per_worker:
        r.fail("spec.parallelism.tensor", f"{tensor} does not divide or fill whole workers of "
               f"{per_worker} GPUs; a tensor-parallel group must sit inside NVLink reach")
    e = r.mapping(s.get("elastic"), "spec.elastic", ("min_workers", "max_workers"))
    low = r.integer(e, "min_workers", "spec.elastic", default=workers)
    high = r.integer(e, "max_workers", "spec.elastic", default=workers)
    if not low <= workers <= high:
        r.fail("spec.elastic", f"min_workers {low} <= workers {workers} <= max_workers {high} "
               "does not hold")
    max_runtime = None
    if s.get("max_runtime") is not None:
        max_runtime = parse_duration(s.get("max_runtime"))
        if max_runtime is None:
            r.fail("spec.max_runtime", "must be seconds or a duration like 90m, 24h, 2d, got "
                   f"{s.get('max_runtime')!r}")
    split = s.get("allow_split_across_clusters", False)
    if not isinstance(split, bool):
        r.fail("spec.allow_split_across_clusters", f"must be true or false, got {split!r}")
        split = False
    return TrainingJob(
        metadata=meta, accelerator=accelerator, gpus_per_worker=per_worker, workers=workers,
        parallelism=Parallelism(tensor, pipeline, data),
        communication=r.text(s, "communication", "spec", default="moderate",
                             choices=COMMUNICATION) or "moderate",
        priority_class=r.text(s, "priority_class", "spec", default="normal",
                              choices=PRIORITY_CLASSES) or "normal",
        checkpoint_interval_s=r.integer(s, "checkpoint_interval_s", "spec", default=1800),
        dataset=r.text(s, "dataset", "spec", required=False),
        min_workers=low, max_workers=high, allow_split_across_clusters=split,
        max_runtime_s=max_runtime, region=r.text(s, "region", "spec", required=False))


_INFERENCE = ("model", "accelerator", "gpus_per_replica", "replicas", "latency_target_ms",
              "regions", "priority_class")


def _inference(r: _Reader, meta: Metadata, value: Any) -> InferenceService:
    s = r.mapping(value, "spec", _INFERENCE)
    replicas = r.mapping(s.get("replicas"), "spec.replicas", ("min", "max"))
    low = r.integer(replicas, "min", "spec.replicas", default=1)
    high = r.integer(replicas, "max", "spec.replicas", default=low)
    if low > high:
        r.fail("spec.replicas", f"min {low} is above max {high}")
    latency = s.get("latency_target_ms")
    if isinstance(latency, bool) or not isinstance(latency, int | float) or latency <= 0:
        r.fail("spec.latency_target_ms", f"must be a positive number, got {latency!r}")
        latency = 1.0
    regions = r.names(s, "regions", "spec")
    if not regions:
        r.fail("spec.regions", "must name at least one region")
    return InferenceService(
        metadata=meta, model=r.text(s, "model", "spec") or "",
        accelerator=r.text(s, "accelerator", "spec") or "",
        gpus_per_replica=r.integer(s, "gpus_per_replica", "spec", default=1),
        min_replicas=low, max_replicas=high, latency_target_ms=float(latency), regions=regions,
        priority_class=r.text(s, "priority_class", "spec", default="high",
                              choices=PRIORITY_CLASSES) or "high")


def _dataset(r: _Reader, meta: Metadata, value: Any) -> Dataset:
    s = r.mapping(value, "spec", ("size", "replicas", "source"))
    size = parse_size(s.get("size"))
    if size is None:
        r.fail("spec.size", f"must be bytes or a size like 500GB or 2TiB, got {s.get('size')!r}")
        size = 0
    return Dataset(metadata=meta, size_bytes=size, replicas=r.names(s, "replicas", "spec"),
                   source=r.text(s, "source", "spec", required=False))


_KINDS = {"TrainingJob": _training, "InferenceService": _inference, "Dataset": _dataset}


def parse_spec(document: Any) -> Spec:
    """One parsed document (a mapping) to a spec, or SpecError with every bad field."""
    r = _Reader()
    top = r.mapping(document, "(document)", ("apiVersion", "kind", "metadata", "spec"))
    if document is not None and not isinstance(document, Mapping):
        raise SpecError(r.errors)
    version = top.get("apiVersion", API_VERSION)
    if version != API_VERSION:
        r.fail("apiVersion", f"must be {API_VERSION}, got {version!r}")
    kind = top.get("kind")
    if kind not in _KINDS:
        r.fail("kind", f"must be one of {', '.join(_KINDS)}, got {kind!r}")
        raise SpecError(r.errors)
    meta = _metadata(r, top.get("metadata"))
    spec = _KINDS[kind](r, meta, top.get("spec"))
    if r.errors:
        raise SpecError(r.errors)
    return spec


def parse_specs(text: str) -> list[Spec]:
    """Every document of a YAML (or JSON) text; errors name the document they are in."""
    try:
        documents = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as exc:
        raise SpecError([FieldError("(text)", f"not YAML or JSON: {exc}")]) from None
    if not documents:
        raise SpecError([FieldError("(text)", "no document")])
    specs: list[Spec] = []
    errors: list[FieldError] = []
    for i, document in enumerate(documents):
        try:
            specs.append(parse_spec(document))
        except SpecError as exc:
            prefix = f"document {i + 1}: " if len(documents) > 1 else ""
            errors.extend(FieldError(prefix + e.path, e.message) for e in exc.errors)
    if errors:
        raise SpecError(errors)
    return specs
