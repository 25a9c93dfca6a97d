"""A lab of hosts on one machine: a Linux network namespace per cluster, real links between them.

The control plane (Kafka, the S3 server, `fleetline serve`) stays in the host's namespace on a
bridge, at the lab's control address (10.77.0.1 by default). Each cluster is a namespace with
one address on that bridge (10.77.0.11, .12, ...) through a veth pair, so it reaches the control
plane and the control plane reaches it. Each pair of clusters has a link of its own: a veth from
each namespace to a small bridge of the pair's in the host's namespace, with a host route to the
peer's address over it, so cluster-to-cluster traffic never crosses the control bridge (a
blackhole route under each peer route drops it, rather than sending it that way, should a
namespace's end of the link ever go down).

A cut takes the host's ends of links down (`ip link set ... down`): the namespaces' ends lose
carrier and keep their routes, so packets are dropped as on a dead wire and connections time
out, as they would across a real cut.
- `cut(cluster)`: its control link and every pair link it has. Nothing reaches it, and it
  reaches nothing.
- `cut(cluster, peer)`: the one pair link. The two cannot reach each other; both reach the
  control plane and every other cluster.
- `heal()`: every link up again, and the neighbour entries that failed while cut forgotten.

Everything is made with `ip` (iproute2) as root and recorded in a state file as it is made, so
`down` removes exactly what `up` made, and a failed `up` rolls back what it had made.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from fleetline.errors import ConfigError, FleetlineError, NotPermitted

DEFAULT_SUBNET = "10.77.0.0/16"
DEFAULT_NAME = "fl"
_FIRST_CLUSTER_HOST = 11  # cluster i (0-based) is .11 + i on the control /24
_PEER_METRIC = 10
_CUT_METRIC = 1000
_LAB_GUARD_METRIC = 4242  # the host's blackhole for the lab network, under every real route


class LabError(FleetlineError):
    """A lab command could not do what it was asked (the message says what and why)."""


class NeedsRoot(NotPermitted):
    """Namespaces, links and routes need root."""


@dataclass(frozen=True)
class LabCluster:
    cluster_id: str
    namespace: str
    address: str  # on the control network; what its processes bind and advertise
    index: int


@dataclass
class Lab:
    """A lab as made (or to be made): its names, addresses and which links are cut."""

    name: str
    subnet: str
    bridge: str
    control: str  # the control plane's address on the bridge
    clusters: list[LabCluster]
    cut_links: list[str] = field(default_factory=list)  # "A" or "A|B" (sorted)

    @classmethod
    def plan(
        cls, clusters: Sequence[str], subnet: str = DEFAULT_SUBNET, name: str = DEFAULT_NAME
    ) -> Lab:
        if not 1 <= len(name) <= 6 or not name.isalnum():
            raise ConfigError(
                f"a lab name is 1-6 letters or digits (it prefixes link names), {name!r}"
            )
        try:
            network = ipaddress.ip_network(subnet)
        except ValueError as exc:
            raise ConfigError(f"--subnet {subnet!r} is not a network: {exc}") from None
        if not isinstance(network, ipaddress.IPv4Network) or network.prefixlen > 24:
            raise ConfigError(f"--subnet must be an IPv4 network of /24 or larger, got {subnet}")
        if not network.is_private:
            raise ConfigError(f"--subnet {subnet} is not a private network (RFC 1918)")
        if not 1 <= len(clusters) <= 200:
            raise ConfigError(f"a lab has 1 to 200 clusters, not {len(clusters)}")
        if len(set(clusters)) != len(clusters):
            raise ConfigError(f"cluster names repeat: {list(clusters)}")
        base = network.network_address
        return cls(
            name=name,
            subnet=str(network),
            bridge=f"{name}-br",
            control=str(base + 1),
            clusters=[
                LabCluster(c, f"{name}-{c}", str(base + _FIRST_CLUSTER_HOST + i), i)
                for i, c in enumerate(clusters)
            ],
        )

    def cluster(self, cluster_id: str) -> LabCluster:
        for c in self.clusters:
            if c.cluster_id == cluster_id:
                return c
        raise ConfigError(
            f"no cluster {cluster_id!r} in the lab; it has {[c.cluster_id for c in self.clusters]}"
        )

    # Link names: at most 15 characters, so built from the lab name and indices.
    def control_end(self, c: LabCluster) -> str:
        """The bridge's end of the cluster's control link (in the host's namespace)."""
        return f"{self.name}-c{c.index}"

    def pair_bridge(self, a: LabCluster, b: LabCluster) -> str:
        low, high = sorted((a.index, b.index))
        return f"{self.name}-b{low}x{high}"

    def pair_ports(self, a: LabCluster, b: LabCluster) -> tuple[str, str]:
        """The pair bridge's two ports: what a cut of that pair takes down."""
        return self.pair_port(a, b), self.pair_port(b, a)

    def pair_port(self, here: LabCluster, there: LabCluster) -> str:
        """The pair bridge's port for `here`'s end of its link to `there` (host's namespace)."""
        return f"{self.name}-p{here.index}x{there.index}"

    @staticmethod
    def peer_end(peer: LabCluster) -> str:
        """A cluster's end of its pair link towards `peer` (inside the cluster's namespace)."""
        return f"to-{peer.index}"

    def pairs(self) -> list[tuple[LabCluster, LabCluster]]:
        return [(a, b) for a in self.clusters for b in self.clusters if a.index < b.index]

    def as_data(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def of_data(cls, data: dict[str, Any]) -> Lab:
        # The state file's records beside the lab: what was made, who uses it.
        fields = {k: v for k, v in data.items() if k not in ("made", "users")}
        return cls(**{**fields, "clusters": [LabCluster(**c) for c in data["clusters"]]})


def ip(*args: str, namespace: str | None = None, check: bool = True) -> str:
    """Run `ip ARGS` (in `namespace`); LabError with ip's own message when it fails."""
    command = ["ip", *(("-n", namespace) if namespace else ()), *args]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        raise LabError("`ip` (iproute2) is not installed: apt-get install iproute2") from None
    if check and done.returncode != 0:
        raise LabError(f"`{' '.join(command)}` failed: {done.stderr.strip()}")
    return done.stdout


def require_root() -> None:
    if os.geteuid() != 0:
        raise NeedsRoot("the lab makes network namespaces, links and routes: run it as root (sudo)")


def clashes(subnet: str) -> list[str]:
    """The host's addresses and routes that overlap `subnet` (a lab there would shadow them)."""
    network = ipaddress.ip_network(subnet)
    found = []
    for entry in json.loads(ip("-j", "-4", "addr", "show") or "[]"):
        for info in entry.get("addr_info", []):
            iface = ipaddress.ip_interface(f"{info['local']}/{info['prefixlen']}")
            if iface.network.overlaps(network):
                found.append(f"address {iface} on {entry['ifname']}")
    for route in json.loads(ip("-j", "-4", "route", "show") or "[]"):
        dst = route.get("dst", "")
        if dst and dst != "default" and ipaddress.ip_network(dst, strict=False).overlaps(network):
            found.append(f"route {dst} via {route.get('dev', route.get('gateway', '?'))}")
    return found


class LabHost:
    """Makes, changes and removes a lab on this machine; its state file says what exists."""

    def __init__(self, state_dir: Path, name: str = DEFAULT_NAME) -> None:
        self.state_file = state_dir / "lab" / f"{name}.json"
        self.name = name

    def current(self) -> Lab | None:
        try:
            return Lab.of_data(json.loads(self.state_file.read_text()))
        except FileNotFoundError:
            return None

    def _save(self, lab: Lab, made: list[list[str]]) -> None:
        users = self._registered()
        self.state_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps({**lab.as_data(), "made": made, "users": users}, indent=2))
        tmp.replace(self.state_file)

    def _made(self) -> list[list[str]]:
        try:
            made: list[list[str]] = json.loads(self.state_file.read_text()).get("made", [])
        except FileNotFoundError:
            return []
        return made

    # -- up -------------------------------------------------------------------------------------

    def up(self, lab: Lab) -> Lab:
        """Make the lab, or fail having made nothing (what was made is removed again)."""
        require_root()
        if self.current() is not None:
            raise LabError(
                f"a lab named {self.name!r} is up already ({self.state_file}); "
                "`fleetline lab down` first"
            )
        found = clashes(lab.subnet)
        if found:
            raise LabError(
                f"--subnet {lab.subnet} clashes with this host's {found[0]}"
                + (f" (and {len(found) - 1} more)" if len(found) > 1 else "")
                + "; pick another --subnet"
            )
        namespaces = set(ip("netns", "list").split())
        taken = [c.namespace for c in lab.clusters if c.namespace in namespaces]
        if taken:
            raise LabError(
                f"network namespace {taken[0]} exists already; remove it or rename the lab"
            )
        made: list[list[str]] = []  # ("netns", name) or ("link", name): what to remove, in order

        def record(kind: str, name: str) -> None:
            made.append([kind, name])
            self._save(lab, made)

        try:
            self._make(lab, record)
        except BaseException:
            self._remove(made)
            with contextlib.suppress(FileNotFoundError):
                self.state_file.unlink()
            raise
        return lab

    def _make(self, lab: Lab, record: Callable[[str, str], None]) -> None:
        # The whole lab network is a blackhole for the host, under the bridge's own routes: a
        # process still sending to a lab address while the lab goes (its bridge gone first)
        # has it dropped here, never sent out through the host's default route.
        ip("route", "add", "blackhole", lab.subnet, "metric", str(_LAB_GUARD_METRIC))
        record("route", lab.subnet)
        ip("link", "add", lab.bridge, "type", "bridge")
        record("link", lab.bridge)
        ip("addr", "add", f"{lab.control}/24", "dev", lab.bridge)
        ip("link", "set", lab.bridge, "up")
        for c in lab.clusters:
            ip("netns", "add", c.namespace)
            record("netns", c.namespace)
            ip("link", "set", "lo", "up", namespace=c.namespace)
            end = lab.control_end(c)
            ip("link", "add", end, "type", "veth", "peer", "name", "ctl0", "netns", c.namespace)
            record("link", end)
            ip("link", "set", end, "master", lab.bridge)
            ip("link", "set", end, "up")
            ip("addr", "add", f"{c.address}/24", "dev", "ctl0", namespace=c.namespace)
            ip("link", "set", "ctl0", "up", namespace=c.namespace)
        for a, b in lab.pairs():
            # Each end of a pair's link is a veth from the cluster's namespace to a small bridge
            # of the pair's in the host's: a cut takes the bridge's ports down, so both clusters'
            # ends lose carrier and keep their routes, and traffic is dropped as on a dead wire.
            bridge = lab.pair_bridge(a, b)
            ip("link", "add", bridge, "type", "bridge")
            record("link", bridge)
            ip("link", "set", bridge, "up")
            for here, there in ((a, b), (b, a)):
                port = lab.pair_port(here, there)
                ip(
                    "link", "add", port, "type", "veth",
                    "peer", "name", lab.peer_end(there), "netns", here.namespace,
                )  # fmt: skip
                record("link", port)
                ip("link", "set", port, "master", bridge)
                ip("link", "set", port, "up")
                ip("link", "set", lab.peer_end(there), "up", namespace=here.namespace)
                ip(
                    "route", "add", "blackhole", f"{there.address}/32",
                    "metric", str(_CUT_METRIC), namespace=here.namespace,
                )  # fmt: skip
        self._peer_routes(lab)

    def _peer_routes(self, lab: Lab) -> None:
        """The route to each peer over its pair link (`replace`: put back by a heal, should
        anything have taken a namespace's end of a link down and its route with it)."""
        for a, b in lab.pairs():
            for here, there in ((a, b), (b, a)):
                ip(
                    "route", "replace", f"{there.address}/32", "dev", lab.peer_end(there),
                    "src", here.address, "metric", str(_PEER_METRIC), namespace=here.namespace,
                )  # fmt: skip

    # -- cuts -----------------------------------------------------------------------------------

    def cut(self, cluster_id: str, peer: str | None = None) -> Lab:
        require_root()
        lab = self._lab()
        here = lab.cluster(cluster_id)
        if peer is not None:
            there = lab.cluster(peer)
            if there == here:
                raise ConfigError(f"--from {peer}: a cluster has no link to itself")
            for port in lab.pair_ports(here, there):
                ip("link", "set", port, "down")
            key = "|".join(sorted((here.cluster_id, there.cluster_id)))
        else:
            ip("link", "set", lab.control_end(here), "down")
            for other in lab.clusters:
                if other != here:
                    for port in lab.pair_ports(here, other):
                        ip("link", "set", port, "down")
            key = here.cluster_id
        if key not in lab.cut_links:
            lab.cut_links.append(key)
        self._save(lab, self._made())
        return lab

    def heal(self) -> Lab:
        """Every link up again, with the routes the cuts took."""
        require_root()
        lab = self._lab()
        for c in lab.clusters:
            ip("link", "set", lab.control_end(c), "up")
        for a, b in lab.pairs():
            for port in lab.pair_ports(a, b):
                ip("link", "set", port, "up")
        lab.cut_links = []
        self._peer_routes(lab)
        # Addresses that failed to resolve while cut would answer "no route to host" for a
        # while after the link is back: forget them.
        for c in lab.clusters:
            ip("neigh", "flush", "all", namespace=c.namespace, check=False)
        ip("neigh", "flush", "dev", lab.bridge, check=False)
        self._save(lab, self._made())
        return lab

    def _lab(self) -> Lab:
        lab = self.current()
        if lab is None:
            raise LabError(f"no lab named {self.name!r} is up; `fleetline lab up` first")
        return lab

    # -- down -----------------------------------------------------------------------------------

    def down(
        self, grace_s: float = 5.0, say: Callable[[str], None] = lambda line: None
    ) -> list[str]:
        """Stop every process in the lab's namespaces and every process of the host's that
        still uses the lab (a `run --lab` that registered, anything with a socket on a lab
        address: the control plane's broker and S3 server on the lab's address, their
        clients), saying which, then remove all the lab made; what it removed. No lab process
        outlives its namespaces, and nothing is left sending to a lab address."""
        require_root()
        lab = self.current()
        made = self._made()
        if lab is None:
            return []
        for c in lab.clusters:
            stop_processes(c.namespace, grace_s)
        users = lab_users(lab, self._users())
        if users:
            say(
                f"stopping {len(users)} process(es) still using lab {lab.name} first: "
                + "; ".join(f"pid {pid} ({what})" for pid, what in sorted(users.items()))
            )
            stop_pids(lambda: sorted(lab_users(lab, self._users())), grace_s)
        removed = self._remove(made)
        self.state_file.unlink()
        return removed

    # -- who uses it ----------------------------------------------------------------------------

    def _registered(self) -> dict[str, list[str]]:
        """pid -> [what, its start time]: the processes that said they use the lab."""
        try:
            users: dict[str, list[str]] = json.loads(self.state_file.read_text()).get("users", {})
        except FileNotFoundError:
            return {}
        return users

    def _users(self) -> dict[int, str]:
        """The registered processes still running (the same process: a pid reused since by
        another has another start time, and is not one of them)."""
        return {
            int(pid): what
            for pid, (what, started) in self._registered().items()
            if _started(int(pid)) == started
        }

    def _set_users(self, users: dict[int, str]) -> None:
        lab = self.current()
        if lab is None:
            return
        data = json.loads(self.state_file.read_text())
        data["users"] = {str(pid): [what, _started(pid)] for pid, what in users.items()}
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=2))
        tmp.replace(self.state_file)

    @contextlib.contextmanager
    def used_by(self, what: str, pid: int | None = None) -> Iterator[None]:
        """While the block runs, the lab knows this process uses it (`down` stops it first)."""
        pid = os.getpid() if pid is None else pid
        self._set_users({**self._users(), pid: what})
        try:
            yield
        finally:
            self._set_users({p: w for p, w in self._users().items() if p != pid})

    def _remove(self, made: list[list[str]]) -> list[str]:
        removed = []
        namespaces = set(ip("netns", "list", check=False).split())
        for kind, name in reversed(made):
            if kind == "netns" and name in namespaces:
                # Deleting a namespace deletes its ends of every link, and so their peers.
                ip("netns", "del", name, check=False)
                removed.append(f"namespace {name}")
            elif kind == "link" and ip("link", "show", name, check=False):
                ip("link", "del", name, check=False)
                removed.append(f"link {name}")
            elif kind == "route" and ip("route", "show", "type", "blackhole", name, check=False):
                ip("route", "del", "blackhole", name, "metric", str(_LAB_GUARD_METRIC), check=False)
                removed.append(f"route blackhole {name}")
        return removed


def lab_subnets(state_dir: Path) -> list[str]:
    """The subnets of the labs up on this machine (their state files under `state_dir`)."""
    out = []
    for state in sorted((state_dir / "lab").glob("*.json")):
        try:
            out.append(str(json.loads(state.read_text())["subnet"]))
        except (OSError, ValueError, KeyError):
            continue
    return out


def namespace_pids(namespace: str) -> list[int]:
    return [int(p) for p in ip("netns", "pids", namespace, check=False).split() if p.isdigit()]


def stop_processes(namespace: str, grace_s: float = 5.0) -> None:
    """SIGTERM every process in the namespace, then SIGKILL what is left after `grace_s`."""
    stop_pids(lambda: namespace_pids(namespace), grace_s)


def lab_users(lab: Lab, registered: dict[int, str]) -> dict[int, str]:
    """The host's processes that use the lab, but this one: those registered (`used_by`) and
    still running, and any with a TCP or UDP socket whose local or remote address is a lab
    address (`ss`)."""
    network = ipaddress.ip_network(lab.subnet)
    users = dict(registered)
    for pid, address in socket_owners():
        try:
            end = ipaddress.ip_address(address)
        except ValueError:  # "*", a wildcard end
            continue
        if isinstance(end, ipaddress.IPv6Address) and end.ipv4_mapped is not None:
            end = end.ipv4_mapped
        if end in network and pid not in users:
            users[pid] = _command_of(pid) + f", a socket on {end}"
    users.pop(os.getpid(), None)
    return users


_SS_PID = re.compile(r"pid=(\d+)")


def socket_owners() -> list[tuple[int, str]]:
    """(pid, address) for each end of each TCP and UDP socket in the host's namespace."""
    try:
        done = subprocess.run(
            ["ss", "-tunapH"], capture_output=True, text=True, timeout=30, check=False
        )
    except FileNotFoundError:
        raise LabError("`ss` (iproute2) is not installed: apt-get install iproute2") from None
    out: list[tuple[int, str]] = []
    for line in done.stdout.splitlines():
        fields = line.split()
        if len(fields) < 6:
            continue
        ends = [f.rsplit(":", 1)[0].strip("[]").split("%")[0] for f in fields[4:6]]
        for pid in _SS_PID.findall(line):
            out.extend((int(pid), end) for end in ends)
    return out


def _started(pid: int) -> str:
    """A process's start time in clock ticks since boot ("" when there is none)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


def _command_of(pid: int) -> str:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return "gone"
    return " ".join(a.decode(errors="replace") for a in argv if a)[:80]


def stop_pids(pids_now: Callable[[], list[int]], grace_s: float) -> None:
    """SIGTERM every process `pids_now` names, then SIGKILL those it still names after
    `grace_s` (a broker waiting for a controller on a removed address ignores SIGTERM)."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 2.0)):
        pids = pids_now()
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait_s
        while pids_now() and time.monotonic() < deadline:
            time.sleep(0.1)


def exec_argv(lab: Lab, cluster_id: str, command: Sequence[str], env: dict[str, str]) -> list[str]:
    """The argv that runs `command` inside the cluster's namespace, as one of its hosts: it
    binds and advertises the cluster's address, and reaches Kafka and S3 at the control address
    where the settings name loopback (loopback inside a namespace is the namespace's own)."""
    c = lab.cluster(cluster_id)
    overrides = {
        "FLEETLINE_ADVERTISE_HOST": c.address,
        "FLEETLINE_LAB_CLUSTER": c.cluster_id,
    }
    for name, default_port in (
        ("FLEETLINE_KAFKA_BOOTSTRAP", "19092"),
        ("FLEETLINE_S3_ENDPOINT", "19000"),
    ):
        value = env.get(name, f"127.0.0.1:{default_port}")
        servers = []
        for server in value.split(","):
            host, _, port = server.strip().rpartition(":")
            servers.append(f"{lab.control}:{port}" if _loopback(host) else server.strip())
        overrides[name] = ",".join(servers)
    return [
        "ip", "netns", "exec", c.namespace, "env",
        *(f"{k}={v}" for k, v in sorted(overrides.items())),
        *command,
    ]  # fmt: skip


def _loopback(host: str) -> bool:
    if host in ("", "localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
