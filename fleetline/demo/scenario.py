"""Scenarios: a simulated fleet's story as data (YAML), read and checked here.

A scenario names its clusters (region, nodes, GPU model and what their operator declares:
price, energy price, PUE), the round-trip times between regions, and a timeline: faults with
their times, malformed messages, tenants' policies and specs submitted at given intervals.
`fleetline run --scenario NAME` plays one on the real stack (`demo/play.py`); the end-to-end
tests play them too. Adding a demo or an end-to-end case is adding a YAML file.

Times are intervals from the start (`at_tick: 3`), or relative to the run's length, which
`fleetline run --ticks` may change: `half`, `half+1`, `end-2`. Fault targets are written as the
simulator names them (`target: us-east-a-n0000/3`) or found in the fleet, so they stay right
when `--nodes` changes the fleet's size: `node: {cluster: ap-south-a, index: -1}` (its last
node), `gpu: {cluster: us-east-a, node: 0, index: 3}`, `leaf_of: {cluster: eu-west-a, node: 0}`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from fleetline.agents.cluster.backends import BACKENDS
from fleetline.agents.simulator import FAULT_KINDS, ClusterSpec, Fault, FleetSimulator
from fleetline.errors import ConfigError
from fleetline.processors.scheduling.specs import Cluster, ClusterMetadata, parse_spec
from fleetline.processors.scheduling.specs import ClusterSpec as ClusterDeclaration

SCENARIO_DIR = Path(__file__).resolve().parent / "scenarios"
_TICK = re.compile(r"^\s*(?:(?P<anchor>half|end)\s*)?(?:(?P<sign>[+-])?\s*(?P<n>\d+))?\s*$")


@dataclass(frozen=True)
class ClusterPlan:
    """A cluster of the scenario: the simulator's shape and its operator's declared facts."""

    spec: ClusterSpec
    kind: str = "CLOUD"
    price_per_gpu_hour: float | None = None
    energy_price_per_kwh: float | None = None
    pue: float | None = None
    # How its cluster agent runs workloads (`cluster-agent --backend`): processes, or jobs of a
    # Slurm cluster `fleetline run` starts for it.
    manager: str = "process"


@dataclass(frozen=True)
class FaultPlan:
    kind: str
    target: Any  # a literal target, or a selector mapping resolved against the fleet
    selector: str  # "target", "node", "gpu", "leaf_of" or "cluster"
    at: str
    lasts: int | None = None  # intervals; None: for the rest of the run
    value: float = 0.0


@dataclass(frozen=True)
class Event:
    """What happens at one interval besides telemetry: notes, policies, specs, bad input."""

    at: str
    note: str | None = None
    tenant_policies: tuple[Mapping[str, Any], ...] = ()
    apply: tuple[Mapping[str, Any], ...] = ()
    malformed: tuple[Mapping[str, Any], ...] = ()


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    seed: int
    ticks: int
    interval_ms: int
    clusters: tuple[ClusterPlan, ...]
    region_latency_ms: Mapping[tuple[str, str], float]
    faults: tuple[FaultPlan, ...] = ()
    events: tuple[Event, ...] = ()
    # After the timeline: the cluster this job runs in goes dark and the job moves (tenant/name).
    lose_cluster_of: str | None = None
    # After that: a compressed day of an inference service (demo/serving_story.py).
    serving_day: Mapping[str, Any] | None = None
    # After the timeline: this job, split across clusters, followed to its end (tenant/name).
    split_job: str | None = None
    # After that: a dataset of real objects copied to where its job can run (prewarm_story.py).
    prewarm: Mapping[str, Any] | None = None
    source: Path | None = field(default=None, compare=False)

    def sized(
        self, *, nodes: int | None = None, clusters: int | None = None, ticks: int | None = None
    ) -> Scenario:
        """The scenario with another fleet size or length (`fleetline run`'s flags); faults
        on clusters left out are left out."""
        plans = self.clusters[:clusters] if clusters else self.clusters
        if nodes is not None:
            plans = tuple(replace(p, spec=replace(p.spec, nodes=nodes)) for p in plans)
        kept = {p.spec.cluster_id for p in plans}
        return replace(
            self,
            clusters=plans,
            ticks=ticks or self.ticks,
            faults=tuple(
                f for f in self.faults if _cluster_of(f) in kept or _cluster_of(f) is None
            ),
        )

    def tick_of(self, expression: str) -> int:
        """The interval an `at` expression names, for this scenario's length."""
        return tick_of(expression, self.ticks)

    def latency(self, region: str, other: str) -> float:
        if region == other:
            return 0.5
        return self.region_latency_ms.get(
            (region, other), self.region_latency_ms.get((other, region), 150.0)
        )

    def cluster_documents(self) -> list[Cluster]:
        """A Cluster document per cluster: what its operator declares (`fleetline apply`)."""
        regions = sorted(
            {r for pair in self.region_latency_ms for r in pair}
            | {p.spec.region for p in self.clusters}
        )
        return [
            Cluster(
                metadata=ClusterMetadata(name=p.spec.cluster_id),
                spec=ClusterDeclaration(
                    region=p.spec.region,
                    kind="on-premises" if p.kind == "ON_PREMISES" else "cloud",
                    price_per_gpu_hour=p.price_per_gpu_hour,
                    energy_price_per_kwh=p.energy_price_per_kwh,
                    pue=p.pue,
                    link_latency_ms={r: self.latency(p.spec.region, r) for r in regions},
                ),
            )
            for p in self.clusters
        ]

    def documents(self) -> list[Mapping[str, Any]]:
        """Every spec the scenario applies: its timeline's, its serving day's, its prewarm's."""
        out = [d for event in self.events for d in event.apply]
        for part in (self.serving_day, self.prewarm):
            out += list((part or {}).get("apply") or ())
        return out

    def needs(self) -> tuple[str, ...]:
        """The host's tools playing it needs (keys of `infra/needs.TOOLS`): Open MPI where a
        training job has several workers or one runs under Slurm (`srun --mpi=pmix`), and
        each cluster manager it runs."""
        managers = {p.manager for p in self.clusters}
        several = self.split_job is not None or any(
            d.get("kind") == "TrainingJob" and int((d.get("spec") or {}).get("workers", 1)) > 1
            for d in self.documents()
        )
        needs = ["mpi"] if several or "slurm" in managers else []
        return (*needs, *(m for m in ("slurm", "kubernetes") if m in managers))

    def faults_in(self, simulator: FleetSimulator, start_ms: int) -> list[Fault]:
        """The scenario's faults with their targets found in the simulated fleet."""
        out = []
        for plan in self.faults:
            begin = start_ms + self.tick_of(plan.at) * simulator.interval_ms
            end = None if plan.lasts is None else begin + plan.lasts * simulator.interval_ms
            out.append(Fault(plan.kind, _target(plan, simulator), begin, end, plan.value))
        return out


def tick_of(expression: str | int, ticks: int) -> int:
    """`3`, `half`, `half+1`, `end-2` -> an interval number within a run of `ticks`."""
    match = _TICK.match(str(expression))
    if match is None or (match["anchor"] is None and match["n"] is None):
        raise ConfigError(f"at {expression!r}: expected N, half, half+N or end-N")
    base = {None: 0, "half": ticks // 2, "end": ticks}[match["anchor"]]
    step = int(match["n"] or 0) * (-1 if match["sign"] == "-" else 1)
    return base + step


def _cluster_of(plan: FaultPlan) -> str | None:
    if isinstance(plan.target, Mapping):
        return str(plan.target.get("cluster"))
    if plan.selector == "cluster":
        return str(plan.target)
    return None


def _nth(simulator: FleetSimulator, where: Mapping[str, Any], key: str, what: str) -> str:
    cluster = where.get("cluster")
    nodes = [n for n in simulator.nodes if n.cluster_id == cluster]
    index = where.get(key, 0)
    if not nodes or not isinstance(index, int) or not -len(nodes) <= index < len(nodes):
        raise ConfigError(f"{what}: no node {index!r} in cluster {cluster!r} ({len(nodes)} nodes)")
    return nodes[index].node_id


def _target(plan: FaultPlan, simulator: FleetSimulator) -> str:
    what = f"{plan.kind} fault at {plan.at}"
    if plan.selector in ("target", "cluster"):
        return str(plan.target)
    where = plan.target
    if plan.selector == "node":
        return _nth(simulator, where, "index", what)
    if plan.selector == "gpu":
        return f"{_nth(simulator, where, 'node', what)}/{int(where.get('index', 0))}"
    return simulator.node(_nth(simulator, where, "node", what)).leaf_switch  # leaf_of


def _known(item: Mapping[str, Any], allowed: set[str], where: str) -> None:
    unknown = set(item) - allowed
    if unknown:
        raise ConfigError(f"{where}: unknown fields {sorted(unknown)}; known: {sorted(allowed)}")


def _mapping(value: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where}: expected a mapping, got {type(value).__name__}")
    return value


def _list(value: Any, where: str) -> Sequence[Any]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise ConfigError(f"{where}: expected a list, got {type(value).__name__}")
    return value


def _cluster(item: Any, number: int) -> ClusterPlan:
    where = f"clusters[{number}]"
    data = _mapping(item, where)
    _known(
        data,
        {
            "id",
            "region",
            "nodes",
            "model",
            "nodes_per_leaf",
            "kind",
            "price_per_gpu_hour",
            "energy_price_per_kwh",
            "pue",
            "manager",
        },
        where,
    )
    manager = str(data.get("manager", "process"))
    if manager not in BACKENDS:
        raise ConfigError(f"{where}: manager must be one of {', '.join(BACKENDS)}, got {manager!r}")
    try:
        spec = ClusterSpec(str(data["id"]), str(data["region"]), int(data.get("nodes", 4)))
        if "model" in data:
            spec = replace(spec, model=str(data["model"]))
        if "nodes_per_leaf" in data:
            spec = replace(spec, nodes_per_leaf=int(data["nodes_per_leaf"]))
        numbers = {
            name: None if data.get(name) is None else float(data[name])
            for name in ("price_per_gpu_hour", "energy_price_per_kwh", "pue")
        }
    except KeyError as exc:
        raise ConfigError(f"{where}: {exc.args[0]} is required") from None
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: {exc}") from None
    return ClusterPlan(spec, str(data.get("kind", "CLOUD")), **numbers, manager=manager)


_SELECTORS = ("target", "node", "gpu", "leaf_of", "cluster")


def _fault(item: Any, number: int) -> FaultPlan:
    where = f"faults[{number}]"
    data = _mapping(item, where)
    _known(data, {"kind", "at", "for", "value", *_SELECTORS}, where)
    if data.get("kind") not in FAULT_KINDS:
        raise ConfigError(
            f"{where}: kind must be one of {', '.join(FAULT_KINDS)}, got {data.get('kind')!r}"
        )
    chosen = [s for s in _SELECTORS if s in data]
    if len(chosen) != 1:
        raise ConfigError(f"{where}: name the target once, as one of {', '.join(_SELECTORS)}")
    selector = chosen[0]
    if selector in ("node", "gpu", "leaf_of"):
        _mapping(data[selector], f"{where}.{selector}")
    tick_of(data.get("at", 0), 10)  # refuse a bad expression here, not mid-run
    try:
        lasts = None if data.get("for") is None else int(data["for"])
        value = float(data.get("value", 0.0))
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: {exc}") from None
    return FaultPlan(
        str(data["kind"]), data[selector], selector, str(data.get("at", 0)), lasts, value
    )


def _event(item: Any, number: int) -> Event:
    where = f"timeline[{number}]"
    data = _mapping(item, where)
    _known(data, {"at", "note", "tenant_policies", "apply", "malformed"}, where)
    if "at" not in data:
        raise ConfigError(f"{where}: at is required")
    tick_of(data["at"], 10)
    for name in ("tenant_policies", "apply", "malformed"):
        for index, entry in enumerate(_list(data.get(name), f"{where}.{name}")):
            _mapping(entry, f"{where}.{name}[{index}]")
    for index, bad in enumerate(_list(data.get("malformed"), f"{where}.malformed")):
        _known(bad, {"topic", "key", "value"}, f"{where}.malformed[{index}]")
    return Event(
        str(data["at"]),
        data.get("note"),
        tuple(_list(data.get("tenant_policies"), where)),
        tuple(_list(data.get("apply"), where)),
        tuple(_list(data.get("malformed"), where)),
    )


def parse(data: Any, name: str = "scenario", source: Path | None = None) -> Scenario:
    """A scenario from parsed YAML; ConfigError names what is wrong and where."""
    top = _mapping(data, name)
    _known(
        top,
        {
            "name",
            "description",
            "seed",
            "ticks",
            "interval_ms",
            "clusters",
            "region_latency_ms",
            "faults",
            "timeline",
            "lose_cluster_of",
            "serving_day",
            "split_job",
            "prewarm",
        },
        name,
    )
    clusters = tuple(_cluster(c, i) for i, c in enumerate(_list(top.get("clusters"), "clusters")))
    if not clusters:
        raise ConfigError(f"{name}: a scenario needs at least one cluster")
    latency: dict[tuple[str, str], float] = {}
    for pair, ms in _mapping(top.get("region_latency_ms") or {}, "region_latency_ms").items():
        first, sep, second = str(pair).partition("/")
        if not sep:
            raise ConfigError(f"region_latency_ms: {pair!r} is not REGION/REGION")
        latency[(first, second)] = float(ms)
    try:
        seed, ticks = int(top.get("seed", 7)), int(top.get("ticks", 20))
        interval_ms = int(top.get("interval_ms", 1000))
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{name}: {exc}") from None
    return Scenario(
        name=str(top.get("name", name)),
        description=str(top.get("description", "")),
        seed=seed,
        ticks=ticks,
        interval_ms=interval_ms,
        clusters=clusters,
        region_latency_ms=latency,
        faults=tuple(_fault(f, i) for i, f in enumerate(_list(top.get("faults"), "faults"))),
        events=tuple(_event(e, i) for i, e in enumerate(_list(top.get("timeline"), "timeline"))),
        lose_cluster_of=str(top["lose_cluster_of"]) if top.get("lose_cluster_of") else None,
        serving_day=_serving_day(top.get("serving_day")),
        split_job=str(top["split_job"]) if top.get("split_job") else None,
        prewarm=_prewarm(top.get("prewarm"), {c.spec.cluster_id for c in clusters}),
        source=source,
    )


def _prewarm(data: Any, clusters: set[str]) -> Mapping[str, Any] | None:
    if data is None:
        return None
    plan = _mapping(data, "prewarm")
    _known(plan, {"cluster", "objects", "object_mib", "tenant_policies", "apply"}, "prewarm")
    if plan.get("cluster") not in clusters:
        raise ConfigError(f"prewarm.cluster: {plan.get('cluster')!r} is not a scenario cluster")
    for field_name in ("objects", "object_mib"):
        value = plan.get(field_name)
        if not isinstance(value, int) or value < 1:
            raise ConfigError(f"prewarm.{field_name}: a positive whole number, got {value!r}")
    documents = _list(plan.get("apply"), "prewarm.apply")
    kinds = sorted(str(_mapping(d, "prewarm.apply[]").get("kind")) for d in documents)
    if kinds != ["Dataset", "TrainingJob"]:
        raise ConfigError(f"prewarm.apply: one Dataset and one TrainingJob, got {kinds}")
    _list(plan.get("tenant_policies") or [], "prewarm.tenant_policies")
    return plan


def _serving_day(data: Any) -> Mapping[str, Any] | None:
    if data is None:
        return None
    day = _mapping(data, "serving_day")
    _known(
        day, {"policy", "apply", "day_s", "peak_rps", "night", "regions", "report_s"}, "serving_day"
    )
    documents = _list(day.get("apply"), "serving_day.apply")
    kinds = sorted(str(_mapping(d, "serving_day.apply").get("kind")) for d in documents)
    if kinds != ["InferenceService", "TrainingJob"]:
        raise ConfigError("serving_day.apply: one TrainingJob and one InferenceService")
    for document in documents:
        parse_spec(document)
    return day


def available() -> list[str]:
    return sorted(path.stem for path in SCENARIO_DIR.glob("*.yaml"))


def load(name_or_path: str) -> Scenario:
    """A scenario by name (`default`: demo/scenarios/default.yaml) or by file path."""
    path = Path(name_or_path)
    if not path.suffix:
        path = SCENARIO_DIR / f"{name_or_path}.yaml"
    if not path.exists():
        raise ConfigError(
            f"no scenario {name_or_path!r}; known: {', '.join(available())} "
            "(or give a YAML file's path)"
        )
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"scenario {path}: not YAML: {exc}") from None
    return parse(data, path.stem, path)
