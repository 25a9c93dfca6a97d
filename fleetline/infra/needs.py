"""What fleetline's commands need from the host, whether it is here, and the one command that
installs it: the one list `fleetline doctor` prints, `fleetline run` checks before it starts
anything, and `make lint` holds the Makefile's prerequisites to (tools/check_make_needs.py).

A tool is found by a probe that answers its version, or None when it is missing. Each make
target that plays or tests something names, in `MAKE_TARGETS`, the tools it installs first; a
scenario's own needs come from what it plays (`demo/scenario.Scenario.needs`).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from fleetline.errors import ServiceUnavailable
from fleetline.infra.kafka import KAFKA_VERSION
from fleetline.infra.kubernetes import KUBERNETES_VERSION, KubernetesBinaries
from fleetline.infra.s3 import VERSITYGW_VERSION


class MissingTool(ServiceUnavailable):
    """A tool a command needs is not on this host: the message names it and the command that
    installs it (exit 69, before anything starts)."""


@dataclass(frozen=True)
class Tool:
    """Something a command needs from the host."""

    key: str
    name: str
    why: str
    # The one command that installs it; None: its make target (`make_target`).
    how: str | None
    # cache_dir -> its version, or None when it is not here.
    probe: Callable[[Path], str | None]
    # The Makefile target that installs it, for the targets that need it (None: a prerequisite
    # the README names, or something a command fetches itself on first use).
    make_target: str | None = None

    @property
    def install(self) -> str:
        return self.how or f"make {self.make_target}"


_ESCAPES = re.compile(r"\x1b\[[0-9;]*m")  # a terminal's colours (Maven prints them)


def _first_line(argv: Sequence[str]) -> str | None:
    """The first non-empty line a program prints about itself, or None if it is not here."""
    if shutil.which(argv[0]) is None:
        return None
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    text = _ESCAPES.sub("", done.stdout or done.stderr)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[0] if lines else "present"


def _programs(names: Iterable[str], version: Sequence[str]) -> Callable[[Path], str | None]:
    """Here when every program is on PATH; the version from the first one's `version` argv."""
    wanted = tuple(names)

    def probe(_: Path) -> str | None:
        if any(shutil.which(n) is None for n in wanted):
            return None
        return _first_line(version)

    return probe


def _file(path: Callable[[Path], Path], version: str) -> Callable[[Path], str | None]:
    return lambda cache_dir: version if path(cache_dir).exists() else None


def _kubernetes(cache_dir: Path) -> str | None:
    return None if KubernetesBinaries(cache_dir).missing() else KUBERNETES_VERSION


def _root(_: Path) -> str | None:
    return "uid 0" if os.geteuid() == 0 else None


TOOLS: tuple[Tool, ...] = (
    Tool(
        "java",
        "Java 17+",
        "runs the Kafka broker",
        "apt-get install -y openjdk-17-jre-headless",
        _programs(["java"], ["java", "-version"]),
    ),
    Tool(
        "maven",
        "Maven",
        "fetches the Kafka broker's jars once (into .cache/)",
        "apt-get install -y maven",
        _programs(["mvn"], ["mvn", "-B", "--version"]),
    ),
    Tool(
        "go",
        "Go 1.26+",
        "builds the S3 server, Kubernetes and the contract's Go consumer once",
        "a Go 1.26 toolchain on PATH (Debian's golang is too old)",
        _programs(["go"], ["go", "version"]),
    ),
    Tool(
        "kafka",
        f"Kafka {KAFKA_VERSION} broker jars",
        "the broker every command talks to",
        "fleetline infra start (fetches them with Maven the first time)",
        _file(lambda c: c / f"kafka-{KAFKA_VERSION}" / "libs" / ".complete", KAFKA_VERSION),
    ),
    Tool(
        "s3",
        f"versitygw {VERSITYGW_VERSION}",
        "the S3 server: snapshots, checkpoints, tiers, archives",
        "fleetline infra start (builds it with Go the first time)",
        _file(lambda c: c / "bin" / f"versitygw-{VERSITYGW_VERSION}", VERSITYGW_VERSION),
    ),
    Tool(
        "mpi",
        "Open MPI",
        "a training job's workers (mpirun; srun --mpi=pmix under Slurm)",
        None,
        _programs(["mpirun"], ["mpirun", "--version"]),
        make_target="mpi",
    ),
    Tool(
        "slurm",
        "Slurm",
        "Slurm clusters (slurmctld, slurmd, munged, sbatch)",
        None,
        _programs(["slurmctld", "slurmd", "munged", "sbatch"], ["slurmctld", "-V"]),
        make_target="slurm",
    ),
    Tool(
        "kubernetes",
        f"Kubernetes {KUBERNETES_VERSION}",
        "Kubernetes clusters (kube-apiserver, scheduler, controller-manager, etcd, kwok), "
        "built from their Go modules into ~/.cache/fleetline: about 20 min the first time",
        None,
        _kubernetes,
        make_target="kubernetes",
    ),
    Tool(
        "chromium",
        "Chromium",
        "the console's browser tests and the sign-in tests",
        None,
        _programs(["chromium"], ["chromium", "--version"]),
        make_target="chromium",
    ),
    Tool(
        "node",
        "Node.js and npm",
        "the AsyncAPI check (make lint) and the OpenID provider of the sign-in tests",
        "apt-get install -y nodejs npm",
        _programs(["node", "npm"], ["node", "--version"]),
    ),
    Tool(
        "root",
        "root",
        "the lab's namespaces and links (--lab, the link-cut tests)",
        "run as root (sudo)",
        _root,
    ),
)
BY_KEY: Mapping[str, Tool] = {t.key: t for t in TOOLS}

# The tools `fleetline run` needs whatever it plays: the broker and the S3 server (each
# fetched or built on first start by the tool after it, which is then needed too).
SERVICES: tuple[tuple[str, str], ...] = (("kafka", "maven"), ("s3", "go"))
RUN = ("java",)

# What each Makefile target that plays or tests something installs before it runs (the `run`
# target's list is the default scenario's needs; tools/check_make_needs.py holds the Makefile
# to these).
MAKE_TARGETS: Mapping[str, tuple[str, ...]] = {
    "test": ("mpi", "slurm", "kubernetes", "chromium"),
    "chaos": ("mpi",),
    "bench": ("mpi", "slurm", "kubernetes"),  # benchmarks/peers.py runs all three
    "bench-peers": ("slurm", "kubernetes"),
}


@dataclass(frozen=True)
class Finding:
    tool: Tool
    version: str | None

    @property
    def here(self) -> bool:
        return self.version is not None


def examine(cache_dir: Path, keys: Iterable[str] | None = None) -> list[Finding]:
    """Each tool (or those named), found or not."""
    wanted = list(BY_KEY) if keys is None else list(dict.fromkeys(keys))
    return [Finding(BY_KEY[k], BY_KEY[k].probe(cache_dir)) for k in wanted]


def service_needs(cache_dir: Path) -> list[str]:
    """What starting the local services needs now: the broker's runtime, and the fetcher or
    builder of whichever of the broker and the S3 server is not here yet."""
    needs = list(RUN)
    for service, builder in SERVICES:
        needs.append(builder if BY_KEY[service].probe(cache_dir) is None else service)
    return needs


def require(cache_dir: Path, keys: Iterable[str], what: str) -> None:
    """Raise MissingTool, in one line, naming every tool of `keys` that is not here and the
    command that installs each."""
    missing = [f.tool for f in examine(cache_dir, keys) if not f.here]
    if missing:
        raise MissingTool(
            f"{what} needs what this host lacks: "
            + ", ".join(f"{t.name} (`{t.install}`)" for t in missing)
            + "; `fleetline doctor` says what each command needs"
        )
