"""What each accelerator model can do: peak throughput by precision, memory and its bandwidth,
the interconnect, power, and the share of peak a training step reaches. Pure.

The figures live in `catalogue.yaml` beside this module, each model with its source; the
scheduler's work estimate (`processors/scheduling/estimate.py`) reads them, and the view's node
reads show them. An entry with a figure missing, negative or of the wrong kind is refused when
the catalogue is read, with the model and the field named: a wrong figure would misplace every
job that trusts it.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from importlib import resources
from typing import Any

import yaml

from fleetline.errors import ConfigError
from fleetline.processors.view.accelerators import Accelerator, normalise_model
from fleetline.schemas.records import AcceleratorModel

PRECISIONS = ("fp32", "bf16", "fp8", "int8")
_FIELDS = (
    "vendor",
    "peak_tflops",
    "memory_gb",
    "memory_bandwidth_gbps",
    "interconnect",
    "power_w",
    "efficiency",
    "source",
)


@dataclass(frozen=True)
class Capability:
    """One model's figures (per chip)."""

    model: str
    vendor: str
    peak_tflops: tuple[tuple[str, float | None], ...]  # by precision, PRECISIONS' order
    memory_gb: float
    memory_bandwidth_gbps: float
    interconnect: str
    interconnect_gbps: float
    power_w: float
    efficiency: float
    source: str

    def peak(self, precision: str) -> float | None:
        """Dense peak TFLOPS (TOPS for int8) in `precision`; None: the chip has no such
        arithmetic."""
        return dict(self.peak_tflops).get(precision)

    def as_record(self) -> AcceleratorModel:
        """The ClusterInfo `accelerator_models` item that declares it (and how reads show
        it)."""
        return {
            "model": self.model,
            "vendor": self.vendor,
            "peak_tflops": dict(self.peak_tflops),
            "memory_gb": self.memory_gb,
            "memory_bandwidth_gbps": self.memory_bandwidth_gbps,
            "interconnect": self.interconnect,
            "interconnect_gbps": self.interconnect_gbps,
            "power_w": self.power_w,
            "efficiency": self.efficiency,
            "source": self.source,
        }


def of_record(record: Mapping[str, Any]) -> Capability:
    """A declared model from its ClusterInfo item, checked as a catalogue entry is."""
    model = str(record["model"])
    if normalise_model(model) != model or not model:
        raise ConfigError(f"accelerator catalogue: {model!r} is not a model id")
    return _entry(
        model,
        {
            **{k: record[k] for k in ("vendor", "peak_tflops", "memory_gb", "power_w")},
            "memory_bandwidth_gbps": record["memory_bandwidth_gbps"],
            "interconnect": {
                "name": record["interconnect"],
                "bandwidth_gbps": record["interconnect_gbps"],
            },
            "efficiency": record["efficiency"],
            "source": record["source"],
        },
    )


@dataclass(frozen=True)
class Catalogue:
    models: Mapping[str, Capability]

    def of(self, accelerator: Accelerator) -> Capability | None:
        """The figures of a node's chips, by their model id (None: a model not catalogued)."""
        return self.models.get(accelerator.model)

    def with_declared(self, declared: Iterable[Capability]) -> Catalogue:
        """This catalogue with models operators declared (a declared model's figures replace
        the shipped ones; the caller orders the declarations, the last one standing)."""
        models = dict(self.models)
        for capability in declared:
            models[capability.model] = capability
        return Catalogue(models)


def _figure(model: str, name: str, value: Any, *, allow_null: bool = False) -> float | None:
    if value is None and allow_null:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigError(f"accelerator catalogue, {model}: {name} must be a number, not {value!r}")
    if value < 0:
        raise ConfigError(
            f"accelerator catalogue, {model}: {name} is {value}; a figure may not be negative"
        )
    return float(value)


def _entry(model: str, data: Any) -> Capability:
    if not isinstance(data, Mapping):
        raise ConfigError(f"accelerator catalogue, {model}: expected a mapping of its figures")
    for name in _FIELDS:
        if name not in data:
            raise ConfigError(f"accelerator catalogue, {model}: {name} is missing")
    unknown = sorted(set(data) - set(_FIELDS))
    if unknown:
        raise ConfigError(f"accelerator catalogue, {model}: unknown fields {unknown}")
    peaks = data["peak_tflops"]
    if not isinstance(peaks, Mapping):
        raise ConfigError(f"accelerator catalogue, {model}: peak_tflops maps precisions to TFLOPS")
    for precision in PRECISIONS:
        if precision not in peaks:
            raise ConfigError(
                f"accelerator catalogue, {model}: peak_tflops.{precision} is missing "
                "(null says the chip has no such arithmetic)"
            )
    extra = sorted(set(peaks) - set(PRECISIONS))
    if extra:
        raise ConfigError(
            f"accelerator catalogue, {model}: peak_tflops has {extra}; precisions are "
            f"{', '.join(PRECISIONS)}"
        )
    link = data["interconnect"]
    if not isinstance(link, Mapping) or set(link) != {"name", "bandwidth_gbps"}:
        raise ConfigError(
            f"accelerator catalogue, {model}: interconnect is {{name, bandwidth_gbps}}"
        )
    efficiency = _figure(model, "efficiency", data["efficiency"])
    if not efficiency or efficiency > 1:
        raise ConfigError(
            f"accelerator catalogue, {model}: efficiency is a share of peak, above 0 and at most 1"
        )
    for text in ("vendor", "source"):
        if not isinstance(data[text], str) or not data[text].strip():
            raise ConfigError(f"accelerator catalogue, {model}: {text} must be named")
    return Capability(
        model=model,
        vendor=data["vendor"].strip().lower(),
        peak_tflops=tuple(
            (p, _figure(model, f"peak_tflops.{p}", peaks[p], allow_null=True)) for p in PRECISIONS
        ),
        memory_gb=_figure(model, "memory_gb", data["memory_gb"]) or 0.0,
        memory_bandwidth_gbps=_figure(model, "memory_bandwidth_gbps", data["memory_bandwidth_gbps"])
        or 0.0,
        interconnect=str(link["name"]),
        interconnect_gbps=_figure(model, "interconnect.bandwidth_gbps", link["bandwidth_gbps"])
        or 0.0,
        power_w=_figure(model, "power_w", data["power_w"]) or 0.0,
        efficiency=efficiency,
        source=data["source"].strip(),
    )


def parse_catalogue(data: Any) -> Catalogue:
    """A catalogue from its parsed YAML (`{models: {model: figures}}`), every entry checked."""
    if not isinstance(data, Mapping) or not isinstance(data.get("models"), Mapping):
        raise ConfigError("accelerator catalogue: expected `models:` mapping model ids to figures")
    models = {}
    for name, figures in data["models"].items():
        model = normalise_model(str(name))
        if model != name:
            raise ConfigError(
                f"accelerator catalogue: {name!r} is not a model id (as the view names it: "
                f"{model!r})"
            )
        models[model] = _entry(model, figures)
    return Catalogue(models)


_DOMAIN_WORDS = {"nvlink": "NVLink island", "xgmi": "xGMI hive"}


def domain_word(kind: Accelerator, catalogue: Catalogue | None = None) -> str:
    """What one interconnect domain of these chips is called (an NVLink island, an xGMI
    hive, ...)."""
    capability = (catalogue or builtin()).of(kind)
    if capability is None:
        return "NVLink island" if kind.vendor == "nvidia" else "interconnect domain"
    link = capability.interconnect
    return _DOMAIN_WORDS.get(link, f"{link} domain")


@functools.cache
def builtin() -> Catalogue:
    """The catalogue shipped with fleetline (`catalogue.yaml`)."""
    text = resources.files("fleetline.processors.view").joinpath("catalogue.yaml").read_text()
    return parse_catalogue(yaml.safe_load(text))
