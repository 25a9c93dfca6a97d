"""Declarative specs: TrainingJob, InferenceService and Dataset documents (what the scheduler
places), and Cluster documents (what an operator declares of a cluster: its region, prices,
PUE and latencies, folded by the resource view), from YAML or JSON.

Each kind is a Pydantic model shaped like its document (`apiVersion`, `kind`, `metadata`,
`spec`): the one declaration gives validation, typed access and the JSON schema. `parse_specs`
reads one or more documents and returns typed specs, or raises SpecError listing every problem
with its field path (`spec.parallelism: tensor x pipeline x data is 16, the job has 32 GPUs`),
so a user fixes a spec in one round: the models check each field, `_cross_field` the rules that
join fields, and both run on every document. Unknown fields are errors (a typo must not
silently fall back to a default), with the nearest known name suggested.
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Final, Literal, cast, get_args

import yaml
from pydantic import (
    AfterValidator,
    AwareDatetime,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from fleetline.errors import ConfigError, FleetlineError
from fleetline.processors.view.accelerators import MIB_PER_GB, normalise_model, wanted
from fleetline.processors.view.catalogue import Capability, parse_catalogue

API_VERSION: Final = "fleetline/v1"
PriorityClass = Literal["critical", "high", "normal", "low", "best-effort"]
Communication = Literal["heavy", "moderate", "light"]
PRIORITY_CLASSES: tuple[str, ...] = get_args(PriorityClass)
COMMUNICATION: tuple[str, ...] = get_args(Communication)
_NAME = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
_SIZE = re.compile(r"^\s*(?P<n>\d+(\.\d+)?)\s*(?P<unit>[KMGTP]i?B|B)?\s*$")
_UNITS = {
    None: 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "PB": 10**15,
    "KiB": 2**10,
    "MiB": 2**20,
    "GiB": 2**30,
    "TiB": 2**40,
    "PiB": 2**50,
}
_DURATION = re.compile(r"^\s*(?P<n>\d+(\.\d+)?)\s*(?P<unit>s|m|h|d)?\s*$")
_SECONDS = {None: 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


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


def _size(value: Any) -> int:
    size = parse_size(value)
    if size is None:
        raise PydanticCustomError(
            "size",
            "must be bytes or a size like 500GB or 2TiB, got {value}",
            {"value": repr(value)},
        )
    return size


def _duration(value: Any) -> int | None:
    if value is None:
        return None
    seconds = parse_duration(value)
    if seconds is None:
        raise PydanticCustomError(
            "duration",
            "must be seconds or a duration like 90m, 24h, 2d, got {value}",
            {"value": repr(value)},
        )
    return seconds


def _dns_label(what: str) -> Any:
    def check(value: Any) -> Any:
        if isinstance(value, str) and value.strip() and not _NAME.match(value):
            raise PydanticCustomError("label", what + "; got {value}", {"value": repr(value)})
        return value

    return BeforeValidator(check)


Bytes = Annotated[int, BeforeValidator(_size)]
Seconds = Annotated[int | None, BeforeValidator(_duration)]
Count = Annotated[StrictInt, Field(ge=1)]
Text = Annotated[str, Field(strict=True, min_length=1, pattern=r"\S")]
Names = Annotated[tuple[Text, ...], Field(description="cluster or region names")]
Positive = Annotated[float, Field(strict=False, gt=0, allow_inf_nan=False)]


class Model(BaseModel):
    # A typo must not fall back to a default; specs are values, compared and hashed.
    model_config = ConfigDict(extra="forbid", frozen=True)


class Metadata(Model):
    name: Annotated[
        Text,
        _dns_label(
            "must be lower-case letters, digits and '-', at most 63, starting and ending with a "
            "letter or digit"
        ),
    ]
    tenant: Annotated[Text, _dns_label("must be a DNS-style label")]
    labels: dict[Annotated[str, Field(strict=True)], Annotated[str, Field(strict=True)]] = {}


class Parallelism(Model):
    tensor: Count = 1
    pipeline: Count = 1
    data: Count | None = Field(default=None, description="default: the GPUs the others leave")


class Elastic(Model):
    min_workers: Count | None = None
    max_workers: Count | None = None


class Workload(Model):
    """What a cluster agent starts for the job: a command run under fleetline's workload
    contract (environment variables in, checkpoints with a manifest out), by default the
    built-in trainer `fleetline workload train` with the fields below."""

    command: tuple[Text, ...] | None = Field(
        default=None, description="argv; default: fleetline workload train (TrainingJob)"
    )
    steps: Count = 2000
    checkpoint_every_steps: Count = 200
    report_every_steps: Count = 10
    step_delay_ms: Annotated[StrictInt, Field(ge=0)] = 0
    seed: StrictInt = 0
    final_checkpoint: StrictBool = Field(
        default=True, description="checkpoint before stopping on preemption or deletion"
    )
    env: dict[Annotated[str, Field(strict=True, pattern=r"^[A-Z_][A-Z0-9_]*$")], str] = {}


class RetryPolicy(Model):
    """Which failed starts and crashes are retried in place, and how often."""

    max_attempts: Count = 3
    exit_codes: tuple[StrictInt, ...] | None = Field(
        default=None, description="exit codes that retry; default: any failure"
    )
    backoff_s: Annotated[float, Field(strict=False, ge=0, allow_inf_nan=False)] = 2.0

    def retries(self, exit_code: int | None, attempt: int) -> bool:
        if attempt >= self.max_attempts:
            return False
        return self.exit_codes is None or exit_code in self.exit_codes

    def backoff_ms(self, attempt: int) -> int:
        """Wait before attempt `attempt + 1`: doubling from `backoff_s`."""
        return int(self.backoff_s * 1000 * 2 ** max(0, attempt - 1))


class Deferrable(Model):
    """A job that may wait for cheaper or greener hours: it starts when the energy it would
    draw costs least, and no later than `deadline` less `expected_runtime`."""

    deadline: AwareDatetime = Field(description="when it must be done (ISO 8601 with a zone)")
    expected_runtime: Annotated[int, BeforeValidator(_duration)] = Field(
        description="how long it runs (seconds or a duration like 6h)"
    )

    @property
    def deadline_ms(self) -> int:
        return int(self.deadline.timestamp() * 1000)


def _models(value: Any) -> Any:
    names = [value] if isinstance(value, str) else value
    if isinstance(names, list | tuple):
        if not names:
            raise PydanticCustomError("models", "an empty list: leave it out for any model", {})
        for name in names:
            if isinstance(name, str) and name.strip() and not normalise_model(name):
                raise PydanticCustomError(
                    "models", "is not a model name: {value}", {"value": repr(name)}
                )
    return value


Precision = Literal["fp32", "bf16", "fp8", "int8"]


class Work(Model):
    """How much computing a training job does: the scheduler estimates its time and cost on
    each kind of chip from it (the accelerator catalogue's peak in the job's precision x the
    share of peak a step reaches) and prefers the most work per cost that meets the deadline."""

    pflop_per_step: Annotated[float, Field(strict=False, gt=0, allow_inf_nan=False)] = Field(
        description="PFLOP one training step computes, the whole job (all its GPUs)"
    )
    steps: Count = Field(description="steps to run")
    deadline: AwareDatetime | None = Field(
        default=None, description="when it must be done (ISO 8601 with a zone)"
    )
    within: Annotated[int | None, BeforeValidator(_duration)] = Field(
        default=None,
        description="... or how long after its submission (seconds or a duration like 6h)",
    )

    @model_validator(mode="after")
    def _one_deadline(self) -> Work:
        if self.deadline is not None and self.within is not None:
            raise PydanticCustomError("deadline", "give a deadline or `within`, not both", {})
        return self

    def deadline_ms(self, submitted_ms: int) -> int | None:
        """When it must be done: its deadline, or `within` after it was submitted."""
        if self.within is not None:
            return submitted_ms + self.within * 1000
        return None if self.deadline is None else int(self.deadline.timestamp() * 1000)


class GpuKind(Model):
    """Which GPUs the work may run on: a model or family by name, or any, with at least so much
    memory per GPU (names are matched as `processors/view/accelerators.py` says)."""

    accelerator: Annotated[Text | tuple[Text, ...] | None, BeforeValidator(_models)] = Field(
        default=None,
        description="a GPU model or family (H100, h100-80gb-hbm3) or a list of them; default: any",
    )
    min_gpu_memory_gb: Positive | None = Field(
        default=None, description="memory each GPU must have, GB (10^9 bytes, as vendors count)"
    )
    precision: Precision | None = Field(
        default=None,
        description="the arithmetic it computes in (fp32, bf16, fp8, int8): only chips that "
        "have it (the accelerator catalogue says which) take it; default: any",
    )

    @property
    def accelerators(self) -> tuple[str, ...]:
        """The models it names, normalised and sorted; empty: any model."""
        return wanted(self.accelerator)

    @property
    def min_gpu_memory_mib(self) -> int:
        if self.min_gpu_memory_gb is None:
            return 0
        return math.ceil(self.min_gpu_memory_gb * MIB_PER_GB)


class Federated(Model):
    """Federated training: one participant per region where the job's dataset lives, each
    training on its own region's data; only model updates cross regions (FedAvg)."""

    rounds: Count = Field(description="aggregation rounds")
    local_steps: Count = Field(description="steps each participant trains between aggregations")


class TrainingJobSpec(GpuKind):
    gpus_per_worker: Count
    workers: Count
    parallelism: Parallelism = Parallelism()
    communication: Communication = "moderate"
    priority_class: PriorityClass = "normal"
    checkpoint_interval_s: Count = 1800
    dataset: Text | None = None
    elastic: Elastic = Elastic()
    allow_split_across_clusters: StrictBool = False
    max_runtime: Seconds = Field(default=None, description="default: the scheduling policy's")
    region: Text | None = Field(
        default=None, description="where its users or upstream data sit, for the latency score"
    )
    workload: Workload = Workload()
    retry: RetryPolicy = RetryPolicy()
    deferrable: Deferrable | None = Field(
        default=None, description="may wait for cheaper or greener hours (a deadline)"
    )
    portable: StrictBool = Field(
        default=False,
        description="its checkpoints resume on another kind of chip (the workload contract "
        "keeps them portable); otherwise a move keeps it on the model it ran on",
    )
    work: Work | None = Field(
        default=None,
        description="its size (PFLOP per step, steps, a deadline): chooses the chip with the "
        "most work per cost that finishes in time",
    )
    federated: Federated | None = Field(
        default=None,
        description="train where the data lives: one participant of `workers` (1) per region of "
        "its dataset, model updates averaged across them",
    )

    @model_validator(mode="after")
    def _data_parallelism(self) -> TrainingJobSpec:
        if self.parallelism.data is not None:
            return self
        data = max(1, self.gpus // (self.parallelism.tensor * self.parallelism.pipeline))
        return self.model_copy(
            update={"parallelism": self.parallelism.model_copy(update={"data": data})}
        )

    @property
    def gpus(self) -> int:
        return self.gpus_per_worker * self.workers

    @property
    def min_workers(self) -> int:
        return self.elastic.min_workers or self.workers

    @property
    def max_workers(self) -> int:
        return self.elastic.max_workers or self.workers

    @property
    def max_runtime_s(self) -> int | None:
        return self.max_runtime


class Replicas(Model):
    min: Count = 1
    max: Count | None = None


Fraction = Annotated[float, Field(strict=False, gt=0, le=1, allow_inf_nan=False)]


class Autoscaling(Model):
    """When the scheduler adds or drains replicas, from the load the router reports: out as
    soon as a target is passed (at most once per `scale_out_cooldown`), in only when every
    measure is `hysteresis` under its target for `scale_in_cooldown`."""

    target_utilisation: Fraction = Field(
        default=0.7, description="busy share of a replica's request slots"
    )
    target_queue_per_replica: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 2.0
    latency_percentile: Literal[50, 95, 99] = 95
    scale_out_cooldown: Annotated[int, BeforeValidator(_duration)] = 5
    scale_in_cooldown: Annotated[int, BeforeValidator(_duration)] = 30
    hysteresis: Annotated[float, Field(ge=0, lt=1, allow_inf_nan=False)] = 0.3
    warm_standby: Annotated[StrictInt, Field(ge=0)] = Field(
        default=0, description="replicas kept loaded but not routed, promoted on a scale-out"
    )


class Serving(Model):
    """What one replica of `fleetline workload serve` can do."""

    concurrency: Count = Field(default=4, description="requests a replica works on at once")
    compute_ms: Annotated[float, Field(ge=0, allow_inf_nan=False)] = Field(
        default=20.0, description="accelerator time per request (simulated where no GPU)"
    )


# The GPU shares a small replica may ask for: a whole GPU is split in eighths at most.
GPU_SHARES = (0.125, 0.25, 0.5)


def _gpus_per_replica(value: Any) -> Any:
    if isinstance(value, bool):
        raise PydanticCustomError("gpus", "must be a number, got {value}", {"value": value})
    if isinstance(value, float) and value < 1 and value not in GPU_SHARES:
        raise PydanticCustomError(
            "gpus",
            "a share of one GPU must be 0.5, 0.25 or 0.125, got {value}",
            {"value": value},
        )
    if isinstance(value, float) and value >= 1:
        if not value.is_integer():
            raise PydanticCustomError(
                "gpus", "above one GPU must be whole GPUs, got {value}", {"value": value}
            )
        return int(value)
    return value


GpusPerReplica = Annotated[
    float, BeforeValidator(_gpus_per_replica), Field(strict=False, gt=0, allow_inf_nan=False)
]


class InferenceServiceSpec(GpuKind):
    model: Text
    gpus_per_replica: GpusPerReplica = Field(
        default=1,
        description="whole GPUs, or a share of one (0.5, 0.25, 0.125) packed beside others",
    )
    replicas: Replicas = Replicas()
    latency_target_ms: Annotated[float, Field(strict=True, gt=0, allow_inf_nan=False)]
    regions: Annotated[
        Names, Field(min_length=1, description="where it may run, its home region first")
    ]
    priority_class: PriorityClass = "high"
    workload: Workload | None = Field(
        default=None,
        description="what serves a replica (default command: fleetline workload serve); "
        "without one no agent starts it",
    )
    retry: RetryPolicy = RetryPolicy()
    autoscaling: Autoscaling = Autoscaling()
    serving: Serving = Serving()

    @property
    def whole_gpus(self) -> int:
        """GPUs a replica's gang takes in the index: a shared replica's GPU is taken whole (for
        the replicas sharing it)."""
        return max(1, int(self.gpus_per_replica))

    @property
    def share_eighths(self) -> int | None:
        """A shared replica's part of its GPU, in eighths (None: whole GPUs)."""
        return int(self.gpus_per_replica * 8) if self.gpus_per_replica < 1 else None

    @property
    def min_replicas(self) -> int:
        return self.replicas.min

    @property
    def max_replicas(self) -> int:
        return self.replicas.max or self.replicas.min


def dataset_prefix(tenant: str, name: str, source: str | None = None) -> str:
    """Where a dataset's objects are in each cluster's store that holds a replica: its spec's
    `source` prefix, else datasets/<tenant>/<name>/. A prewarm copies them to the same keys."""
    return source if source else f"datasets/{tenant}/{name}/"


def _source_prefix(value: str) -> str:
    parts = value.split("/")
    if (
        not value.endswith("/")
        or {"", ".", ".."} & set(parts[:-1])
        or not re.fullmatch(r"[A-Za-z0-9._/=-]+", value)
    ):
        raise ValueError(
            f"must be a key prefix in each replica cluster's store (each cluster's store is a "
            f"bucket of its own), like corpora/web/: letters, digits, . _ = - and /, ending "
            f"in /, no empty, . or .. part; got {value!r}"
        )
    return value


SourcePrefix = Annotated[
    str,
    Field(
        strict=True,
        description="the key prefix of its objects in each replica cluster's store, ending "
        "in / (default datasets/<tenant>/<name>/); a prewarm copies them to the same keys",
    ),
    AfterValidator(_source_prefix),
]


class DatasetSpec(Model):
    size: Bytes
    replicas: Names = ()
    source: SourcePrefix | None = None
    residency: Names = Field(
        default=(),
        description="the regions its data may be in (empty: any); placement and prewarm "
        "keep it there",
    )
    sensitivity: Literal["public", "internal", "restricted"] = Field(
        default="internal", description="restricted: it must declare its residency"
    )
    sensitive_fields: tuple[Text, ...] = Field(
        default=(),
        description="fields of its records (JSON lines) masked by keyed hashing before any copy "
        "leaves its region",
    )

    @property
    def size_bytes(self) -> int:
        return self.size


class TrainingJob(Model):
    apiVersion: Literal["fleetline/v1"] = API_VERSION
    kind: Literal["TrainingJob"] = "TrainingJob"
    metadata: Metadata
    spec: TrainingJobSpec


class InferenceService(Model):
    apiVersion: Literal["fleetline/v1"] = API_VERSION
    kind: Literal["InferenceService"] = "InferenceService"
    metadata: Metadata
    spec: InferenceServiceSpec


class Dataset(Model):
    apiVersion: Literal["fleetline/v1"] = API_VERSION
    kind: Literal["Dataset"] = "Dataset"
    metadata: Metadata
    spec: DatasetSpec


class ClusterMetadata(Model):
    name: Annotated[Text, _dns_label("must be a DNS-style label, like eu-west-a")]
    labels: dict[Annotated[str, Field(strict=True)], Annotated[str, Field(strict=True)]] = {}


NonNegative = Annotated[float, Field(strict=False, ge=0, allow_inf_nan=False)]


class ClusterSpec(Model):
    region: Text
    kind: Literal["on-premises", "cloud"] = Field(
        default="cloud", description="on-premises or cloud (what the operator owns or rents)"
    )
    price_per_gpu_hour: NonNegative | None = Field(
        default=None, description="what one GPU-hour costs here, in the operator's currency"
    )
    energy_price_per_kwh: NonNegative | None = None
    pue: Annotated[float, Field(ge=1, allow_inf_nan=False)] | None = Field(
        default=None, description="power usage effectiveness of the site, >= 1"
    )
    link_latency_ms: dict[Text, NonNegative] = Field(
        default={}, description="round-trip time from this cluster to each region, ms"
    )
    retired: StrictBool = Field(default=False, description="true takes it out of the pool")
    accelerators: dict[Text, dict[str, Any]] = Field(
        default={},
        description="accelerator models its operator declares, by model id, with the figures "
        "the catalogue (processors/view/catalogue.yaml) gives each model: a model the catalogue "
        "lacks, or corrected figures for one it has",
    )

    @field_validator("accelerators")
    @classmethod
    def _catalogued(cls, value: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        try:
            parse_catalogue({"models": value})
        except ConfigError as exc:
            raise PydanticCustomError("catalogue", "{why}", {"why": str(exc)}) from None
        return value

    def declared_models(self) -> list[Capability]:
        return list(parse_catalogue({"models": self.accelerators}).models.values())


class Cluster(Model):
    """An operator's declaration of one cluster; `apply` appends it to the clusters topic as a
    ClusterInfo record, which the view folds and the scheduler scores with."""

    apiVersion: Literal["fleetline/v1"] = API_VERSION
    kind: Literal["Cluster"] = "Cluster"
    metadata: ClusterMetadata
    spec: ClusterSpec

    def record(self, seq: int, ts_ms: int) -> dict[str, Any]:
        """The ClusterInfo record it declares (its own region at 0.5 ms unless given)."""
        spec = self.spec
        return {
            "cluster_id": self.metadata.name,
            "region": spec.region,
            "seq": seq,
            "ts": ts_ms,
            "kind": "ON_PREMISES" if spec.kind == "on-premises" else "CLOUD",
            "price_per_gpu_hour": spec.price_per_gpu_hour,
            "energy_price_per_kwh": spec.energy_price_per_kwh,
            "pue": spec.pue,
            "link_latency_ms": {spec.region: 0.5, **spec.link_latency_ms},
            "retired": spec.retired,
            "accelerator_models": [m.as_record() for m in spec.declared_models()],
        }


Spec = TrainingJob | InferenceService | Dataset
JobSpec = TrainingJobSpec | InferenceServiceSpec
KINDS: dict[str, type[Spec]] = {
    "TrainingJob": TrainingJob,
    "InferenceService": InferenceService,
    "Dataset": Dataset,
}
# What `apply` takes: the scheduler's kinds, and the clusters operators declare.
Document = Spec | Cluster
DOCUMENT_KINDS: dict[str, type[Document]] = {**KINDS, "Cluster": Cluster}


def _known_fields(model: type[BaseModel], loc: tuple[int | str, ...]) -> list[str]:
    """The field names of the model a location's last part sits in (for "did you mean")."""
    for part in loc[:-1]:
        field = model.model_fields.get(str(part))
        annotation = field.annotation if field is not None else None
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            model = annotation
        else:
            candidates = [
                a
                for a in getattr(annotation, "__args__", ())
                if isinstance(a, type) and issubclass(a, BaseModel)
            ]
            if not candidates:
                return []
            model = candidates[0]
    return list(model.model_fields)


def _message(model: type[BaseModel], error: Any) -> str:
    kind, ctx, value = error["type"], error.get("ctx") or {}, error.get("input")
    if kind == "missing":
        return "is required"
    if kind == "extra_forbidden":
        near = difflib.get_close_matches(
            str(error["loc"][-1]), _known_fields(model, error["loc"]), n=1
        )
        return "unknown field" + (f" (did you mean {near[0]}?)" if near else "")
    if kind in ("int_type", "int_parsing", "int_from_float"):
        return f"must be an integer, got {value!r}"
    if kind == "greater_than_equal":
        return f"must be >= {ctx['ge']}, got {value}"
    if kind in ("greater_than", "finite_number", "float_type", "float_parsing"):
        return f"must be a positive number, got {value!r}"
    if kind == "literal_error":
        return f"must be one of {ctx['expected']}, got {value!r}"
    if kind in ("string_type", "string_too_short", "string_pattern_mismatch"):
        return f"must be a non-empty string, got {value!r}"
    if kind == "bool_type":
        return f"must be true or false, got {value!r}"
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        return f"must be a mapping, got {type(value).__name__}"
    if kind in ("tuple_type", "list_type"):
        return "must be a list of names"
    if kind == "too_short" and error["loc"][-1] == "regions":
        return "must name at least one region"
    return str(error["msg"])


def _int(m: Any, key: str, default: int) -> int:
    """A count the model would accept, or `default`: the cross-field rules run whatever else
    is wrong with the document, so that every problem is named in one round."""
    value = m.get(key) if isinstance(m, Mapping) else None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        return default
    return value


def _cross_field(kind: str, document: Mapping[str, Any]) -> list[FieldError]:
    """The rules that join fields (each field alone is the models')."""
    spec = document.get("spec")
    errors: list[FieldError] = []
    if kind == "TrainingJob":
        per, workers = _int(spec, "gpus_per_worker", 1), _int(spec, "workers", 1)
        p = spec.get("parallelism") if isinstance(spec, Mapping) else None
        tensor, pipeline = _int(p, "tensor", 1), _int(p, "pipeline", 1)
        data = _int(p, "data", max(1, per * workers // (tensor * pipeline)))
        if tensor * pipeline * data != per * workers:
            errors.append(
                FieldError(
                    "spec.parallelism",
                    f"tensor x pipeline x data is "
                    f"{tensor * pipeline * data}, the job has {per * workers}"
                    f" GPUs ({workers} workers x {per})",
                )
            )
        if per % tensor and tensor % per:
            errors.append(
                FieldError(
                    "spec.parallelism.tensor",
                    f"{tensor} does not divide or "
                    f"fill whole workers of {per} GPUs; a tensor-parallel "
                    "group must sit inside NVLink reach",
                )
            )
        if isinstance(spec, Mapping) and spec.get("federated") is not None:
            errors.extend(_federated_errors(spec, workers))
        e = spec.get("elastic") if isinstance(spec, Mapping) else None
        low, high = _int(e, "min_workers", workers), _int(e, "max_workers", workers)
        if not low <= workers <= high:
            errors.append(
                FieldError(
                    "spec.elastic",
                    f"min_workers {low} <= workers {workers} <= max_workers {high} does not hold",
                )
            )
    elif kind == "InferenceService":
        r = spec.get("replicas") if isinstance(spec, Mapping) else None
        low = _int(r, "min", 1)
        high = _int(r, "max", low)
        if low > high:
            errors.append(FieldError("spec.replicas", f"min {low} is above max {high}"))
        regions = spec.get("regions") if isinstance(spec, Mapping) else None
        if isinstance(regions, list) and len(set(map(str, regions))) != len(regions):
            errors.append(FieldError("spec.regions", "names a cluster or region twice"))
    elif kind == "Dataset":
        replicas = spec.get("replicas") if isinstance(spec, Mapping) else None
        if isinstance(replicas, list) and len(set(map(str, replicas))) != len(replicas):
            errors.append(FieldError("spec.replicas", "names a cluster or region twice"))
        if (
            isinstance(spec, Mapping)
            and spec.get("sensitivity") == "restricted"
            and not spec.get("residency")
        ):
            errors.append(
                FieldError(
                    "spec.residency",
                    "a restricted dataset must name the regions its data stays in",
                )
            )
    return errors


def _federated_errors(spec: Mapping[str, Any], workers: int) -> list[FieldError]:
    errors = []
    if not spec.get("dataset"):
        errors.append(FieldError("spec.dataset", "a federated job trains on a dataset; name it"))
    if workers != 1:
        errors.append(FieldError("spec.workers", "a federated job runs one worker per region"))
    if spec.get("allow_split_across_clusters") or spec.get("elastic"):
        errors.append(
            FieldError(
                "spec.federated",
                "a federated job is placed one participant per region: it neither splits "
                "nor shrinks (no allow_split_across_clusters, no elastic)",
            )
        )
    return errors


def parse_spec(document: Any) -> Spec:
    """One parsed document (a mapping) to a spec the scheduler places, or SpecError with
    every bad field."""
    return cast(Spec, parse_document(document, KINDS))  # KINDS holds no Cluster


def parse_document(document: Any, kinds: Mapping[str, type[Document]]) -> Document:
    """One parsed document (a mapping) of one of `kinds`, or SpecError with every bad field."""
    if not isinstance(document, Mapping):
        raise SpecError(
            [FieldError("(document)", f"must be a mapping, got {type(document).__name__}")]
        )
    kind = document.get("kind")
    model = kinds.get(kind) if isinstance(kind, str) else None
    if model is None or not isinstance(kind, str):
        raise SpecError([FieldError("kind", f"must be one of {', '.join(kinds)}, got {kind!r}")])
    errors: list[FieldError] = []
    spec: Document | None = None
    try:
        spec = model.model_validate(document)
    except ValidationError as exc:
        for error in exc.errors():
            path = ".".join(str(part) for part in error["loc"]) or "(document)"
            errors.append(FieldError(path, _message(model, error)))
    errors += [e for e in _cross_field(kind, document) if e.path not in {x.path for x in errors}]
    if errors or spec is None:
        raise SpecError(errors)
    return spec


def parse_specs(text: str) -> list[Spec]:
    """Every spec of a YAML (or JSON) text; errors name the document they are in."""
    return [s for s in parse_documents(text, KINDS) if not isinstance(s, Cluster)]


def parse_documents(text: str, kinds: Mapping[str, type[Document]]) -> list[Document]:
    """Every document of a YAML (or JSON) text, each one of `kinds`; errors name the document
    they are in."""
    try:
        documents = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as exc:
        raise SpecError([FieldError("(text)", f"not YAML or JSON: {exc}")]) from None
    if not documents:
        raise SpecError([FieldError("(text)", "no document")])
    specs: list[Document] = []
    errors: list[FieldError] = []
    for i, document in enumerate(documents):
        try:
            specs.append(parse_document(document, kinds))
        except SpecError as exc:
            prefix = f"document {i + 1}: " if len(documents) > 1 else ""
            errors.extend(FieldError(prefix + e.path, e.message) for e in exc.errors)
    if errors:
        raise SpecError(errors)
    return specs
