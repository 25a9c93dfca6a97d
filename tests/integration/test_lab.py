"""The lab: a network namespace per cluster on this machine, with real links cut and healed
(`ip link set ... down`), checked by connecting across them. Needs root and iproute2, as `fleetline
lab` does; skipped, with the reason, without them."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import fleetline.infra.lab as lab_module
from fleetline.cli import main
from fleetline.infra.lab import Lab, LabError, LabHost, namespace_pids
from tests.support import wait_until

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None, reason="the lab needs root and iproute2"
)
# A name and subnet of the tests' own: a lab an operator has up ("fl", 10.77/16) is left alone.
NAME, SUBNET = "flt", "10.79.0.0/16"
PORT = 7777


def in_namespace(namespace: str | None, code: str, **kwargs) -> subprocess.Popen | str:
    command = [*(["ip", "netns", "exec", namespace] if namespace else []), sys.executable, "-c"]
    if kwargs.get("background"):
        return subprocess.Popen([*command, code])
    return subprocess.run([*command, code], capture_output=True, text=True, timeout=30).stdout


LISTEN = f"""
import socket
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(({{address!r}}, {PORT})); s.listen(64)
while True:
    c, _ = s.accept(); c.sendall(b"here"); c.close()
"""
CONNECT = f"""
import errno, socket
try:
    with socket.create_connection(({{address!r}}, {PORT}), timeout=1) as c:
        print(c.recv(8).decode())
except TimeoutError:
    print("timed out")
except OSError as exc:
    print(errno.errorcode.get(exc.errno, type(exc).__name__))
"""


@pytest.fixture
def lab(tmp_path: Path) -> Iterator[tuple[LabHost, Lab]]:
    host = LabHost(tmp_path, NAME)
    made = host.up(Lab.plan(["a", "b", "c"], SUBNET, NAME))
    # Something listening on every host: the control plane's and each cluster's address.
    listeners = [in_namespace(None, LISTEN.format(address=made.control), background=True)]
    for c in made.clusters:
        listeners.append(
            in_namespace(c.namespace, LISTEN.format(address=c.address), background=True)
        )
    wait_until(
        lambda: reaches(made, "a", "control") and all(reaches(made, None, c) for c in "abc"),
        10,
        what="the listeners",
    )
    try:
        yield host, made
    finally:
        listeners[0].kill()  # the one in the host's namespace; `down` stops the rest
        host.down(grace_s=1)


def reaches(made: Lab, source: str | None, target: str) -> bool:
    """Whether a connection from `source`'s namespace (None: the control plane's) to `target`'s
    address is answered."""
    address = made.control if target == "control" else made.cluster(target).address
    namespace = made.cluster(source).namespace if source else None
    return in_namespace(namespace, CONNECT.format(address=address)).strip() == "here"


def reachability(made: Lab) -> dict[tuple[str | None, str], bool]:
    ends = [None, "a", "b", "c"]
    return {
        (s, t or "control"): reaches(made, s, t or "control") for s in ends for t in ends if s != t
    }


def test_links_cut_for_real_and_heal(lab) -> None:
    host, made = lab
    everything = reachability(made)
    assert all(everything.values()), everything
    # One pair: a and b lose each other only.
    host.cut("a", "b")
    after = reachability(made)
    assert {k for k, ok in after.items() if not ok} == {("a", "b"), ("b", "a")}, after
    # As across a dead wire: no answer at all (then, once the neighbour is given up on, no
    # host), never a refusal or "network unreachable".
    to_b = CONNECT.format(address=made.cluster("b").address)
    assert in_namespace(made.cluster("a").namespace, to_b).strip() in ("timed out", "EHOSTUNREACH")
    host.heal()
    assert all(reachability(made).values())
    # A whole cluster: nothing reaches it, it reaches nothing, the others are untouched.
    host.cut("c")
    after = reachability(made)
    assert {k for k, ok in after.items() if not ok} == {
        (s, t) for s, t in after if "c" in (s, t)
    }, after
    assert host.current().cut_links == ["c"]
    host.heal()
    assert all(reachability(made).values())


def test_down_leaves_nothing_behind(tmp_path: Path) -> None:
    host = LabHost(tmp_path, NAME)
    made = host.up(Lab.plan(["a", "b"], SUBNET, NAME))
    sleeper = in_namespace(
        made.clusters[0].namespace, "import time; time.sleep(60)", background=True
    )
    assert namespace_pids(made.clusters[0].namespace)
    removed = host.down(grace_s=1)
    assert sleeper.wait(10) is not None, "the process in the namespace was stopped"
    # The guard route, the bridge, namespaces and control links, the pair's bridge and ports.
    assert len(removed) == 1 + 1 + 2 * 2 + 1 + 2, removed
    assert_nothing_left(host)


def assert_nothing_left(host: LabHost) -> None:
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not [n for n in namespaces.split() if n.startswith(f"{NAME}-")], namespaces
    links = subprocess.run(["ip", "link"], capture_output=True, text=True).stdout
    assert f"{NAME}-" not in links, links
    routes = subprocess.run(["ip", "route"], capture_output=True, text=True).stdout
    assert SUBNET not in routes, routes
    assert host.current() is None


def test_a_failed_up_rolls_back_what_it_made(tmp_path: Path, monkeypatch) -> None:
    real = lab_module.ip
    calls = {"n": 0}

    def failing(*args, **kwargs):
        calls["n"] += 1
        if args[:2] == ("route", "replace"):
            raise LabError("injected: the last step failed")
        return real(*args, **kwargs)

    monkeypatch.setattr(lab_module, "ip", failing)
    host = LabHost(tmp_path, NAME)
    with pytest.raises(LabError, match="injected"):
        host.up(Lab.plan(["a", "b"], SUBNET, NAME))
    monkeypatch.setattr(lab_module, "ip", real)
    assert calls["n"] > 10
    assert_nothing_left(host)


def test_bad_lab_commands_get_one_line_and_make_nothing(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    monkeypatch.setenv("FLEETLINE_CACHE_DIR", str(tmp_path))
    common = ["--name", NAME]
    assert main(["lab", "up", "--clusters", "2", "--subnet", SUBNET, *common]) == 0
    try:
        capsys.readouterr()
        for argv, message in (
            (
                ["lab", "up", "--subnet", "10.79.0.0/20", "--name", "flu"],
                "clashes with this host's address 10.79.0.1/24",
            ),
            (["lab", "up", "--subnet", SUBNET, *common], "is up already"),
            (["lab", "up", "--subnet", "8.8.0.0/16", "--name", "flu"], "not a private network"),
            (["lab", "cut", "mars", *common], "no cluster 'mars' in the lab"),
            (["lab", "exec", "eu-west-a", *common], "no command given"),
            (["run", "--lab", "--lab-name", "flz"], "no lab named 'flz' is up"),
        ):
            assert main(argv) == 1, argv
            err = capsys.readouterr().err.strip()
            assert message in err and len(err.splitlines()) == 1, (argv, err)
        # Not root: exit 77, one line, before anything is touched.
        done = subprocess.run(
            [
                "setpriv",
                "--reuid=65534",
                "--regid=65534",
                "--clear-groups",
                sys.executable,
                "-m",
                "fleetline.cli",
                "lab",
                "cut",
                "eu-west-a",
                *common,
            ],
            capture_output=True,
            text=True,
            env={**os.environ, "FLEETLINE_CACHE_DIR": str(tmp_path)},
        )
        assert done.returncode == 77 and "run it as root" in done.stderr, done
        assert LabHost(tmp_path, NAME).current().cut_links == []
    finally:
        assert main(["lab", "down", *common]) == 0


def lab_sockets() -> list[str]:
    """The host's processes' TCP and UDP sockets with an end on the tests' lab network (a
    closed connection's TIME-WAIT, which no process holds, is the kernel's)."""
    prefix = SUBNET.split(".0.0/")[0] + "."
    listed = subprocess.run(["ss", "-tunapH"], capture_output=True, text=True).stdout
    return [line for line in listed.splitlines() if prefix in line and "users:(" in line]


def test_the_lab_taken_down_under_a_running_scenario_stops_everything_that_used_it(
    tmp_path: Path, capsys, monkeypatch
) -> None:
    """`lab down` while `fleetline run --lab` plays: the run, its broker and S3 server on the
    lab's address and the agents in its namespaces are stopped first (it says which); within
    seconds no socket of this host has an end on a lab address, and while the lab goes, a lab
    address is a blackhole for the host, never a destination through its default route."""
    from fleetline.config import Settings

    # A cache of the run's own (its broker's and S3 server's data, its CA), with the broker's
    # jars and the S3 server's binary of this checkout's.
    shared, cache = Settings.from_env().cache_dir.resolve(), tmp_path / "cache"
    cache.mkdir()
    for built in (shared / "bin", *shared.glob("kafka-*")):
        (cache / built.name).symlink_to(built)
    host = LabHost(cache, NAME)
    made = host.up(Lab.plan(["eu-west-a", "us-east-a"], SUBNET, NAME))
    story = Path(__file__).parent.parent / "scenarios" / "a-job-that-cannot-start.yaml"
    log = (tmp_path / "run.log").open("w")
    argv = ["run", "--lab", "--lab-name", NAME, "--scenario", str(story), "--ticks", "400"]
    run = subprocess.Popen(
        [sys.executable, "-m", "fleetline.cli", *argv, "--plaintext-kafka"],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "FLEETLINE_CACHE_DIR": str(cache)},
    )
    try:
        # The guard: the whole lab network is a blackhole under the bridge's routes.
        guard = subprocess.run(
            ["ip", "route", "show", "type", "blackhole", SUBNET], capture_output=True, text=True
        ).stdout
        assert "metric 4242" in guard, guard
        wait_until(
            lambda: (
                "scenario a-job-that-cannot-start" in (tmp_path / "run.log").read_text()
                and any(namespace_pids(c.namespace) for c in made.clusters)
            ),
            180,
            what="the run playing in the lab, its agents in the namespaces",
        )
        assert lab_sockets(), "the run's broker listens on the lab's address"
        capsys.readouterr()
        monkeypatch.setenv("FLEETLINE_CACHE_DIR", str(cache))
        assert main(["lab", "down", "--name", NAME]) == 0
        said = capsys.readouterr().out
        assert "still using lab flt first" in said and f"pid {run.pid} (fleetline run --lab" in (
            said
        ), said
        assert run.wait(30) != 0, "the run was stopped with the lab"
        wait_until(lambda: not lab_sockets(), 10, what=f"no socket on the lab: {lab_sockets()}")
        assert_nothing_left(host)
    finally:
        run.kill()
        log.close()
        if host.current() is not None:
            host.down(grace_s=1)
