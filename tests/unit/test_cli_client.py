"""The CLI as an API client: every write command goes through the API with the signed-in
caller's credentials, so a role that may not, another tenant, and a session without the second
factor an admin role needs are refused by the server, in one line and exit code 77."""

from __future__ import annotations

import json
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from fleetline.api.app import create_app
from fleetline.api.auth import AuthConfig, Authenticator
from fleetline.cli import main
from fleetline.processors.view.read import StaticView
from tests.fleet_events import fold
from tests.services import PRINCIPALS, auth_config, free_port, serving
from tests.support import Recorder
from tests.unit.test_api import AUDIENCE, ISSUER, SchedulerPort, jwks, sso_token

TRAIN = """kind: TrainingJob
metadata: {name: train, tenant: acme}
spec: {accelerator: H100, gpus_per_worker: 8, workers: 1, parallelism: {tensor: 8}}
"""


class Server:
    def __init__(self, url: str, recorder: Recorder, port: SchedulerPort) -> None:
        self.url, self.recorder, self.port = url, recorder, port


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[Server]:
    keys = tmp_path_factory.mktemp("sso") / "jwks.json"
    keys.write_text(json.dumps(jwks()))
    config = {
        **auth_config(),
        "jwt": {"jwks_file": keys.name, "issuer": ISSUER, "audience": AUDIENCE},
        # An admin's session needs a second factor; ops' token stays usable for the test's
        # platform-admin calls only because platform-admin is not listed here.
        "require_mfa": ["tenant-admin"],
    }
    recorder, port = Recorder(), SchedulerPort()
    signals: list[dict] = []
    app = create_app(
        StaticView(fold([])),
        Authenticator(AuthConfig.from_data(config, base=keys.parent)),
        recorder,
        jobs=port,
        signals=lambda record: signals.append(dict(record)) or len(signals),
        commands=lambda record: 0,
    )
    with serving(app) as url:
        yield Server(url, recorder, port)


@pytest.fixture
def contexts(tmp_path, monkeypatch) -> Path:
    path = tmp_path / "contexts.yaml"
    monkeypatch.setenv("FLEETLINE_CONTEXTS", str(path))
    for name in ("FLEETLINE_SERVER", "FLEETLINE_TOKEN", "FLEETLINE_CONTEXT"):
        monkeypatch.delenv(name, raising=False)
    return path


def login(server: Server, token: str, name: str = "default") -> int:
    return main(["login", "--server", server.url, "--token", token, "--name", name])


def test_login_keeps_a_context_owner_only_and_refuses_what_it_cannot_check(
    server, contexts, capsys
):
    spec = contexts.parent / "train.yaml"
    spec.write_text(TRAIN)
    assert main(["apply", "-f", str(spec)]) == 1
    assert "not signed in to a fleetline server: `fleetline login" in capsys.readouterr().err
    # An address nobody answers at, a token the server does not know: one line each.
    nobody = f"http://127.0.0.1:{free_port()}"
    assert main(["login", "--server", nobody, "--token", "fl_uma"]) == 69
    assert f"the fleetline API at {nobody} does not answer" in capsys.readouterr().err
    assert login(server, "fl_guess") == 77
    err = capsys.readouterr().err
    assert "refused the credentials" in err and "unknown API token" in err
    assert not contexts.exists()
    assert main(["login", "--server", "ftp://x", "--token", "fl_uma"]) == 1
    assert "is not an http(s)://HOST:PORT address" in capsys.readouterr().err
    # Signed in: the file is the owner's only, and no command prints the token.
    assert login(server, "fl_uma", "acme") == 0
    assert login(server, "fl_ops", "admin") == 0
    out = capsys.readouterr().out
    assert f"signed in to {server.url} as ops (platform-admin)" in out
    assert stat.S_IMODE(contexts.stat().st_mode) == 0o600
    saved = yaml.safe_load(contexts.read_text())
    assert saved["current"] == "admin" and set(saved["contexts"]) == {"acme", "admin"}
    assert main(["context", "list"]) == 0
    listed = capsys.readouterr().out
    assert "acme" in listed and "fl_uma" not in listed
    assert main(["context", "use", "nowhere"]) == 1
    assert main(["logout", "admin"]) == 0
    assert yaml.safe_load(contexts.read_text())["current"] is None


def test_login_takes_one_of_token_or_oidc_and_oidc_needs_the_server_s_provider(
    server, contexts, capsys
):
    assert main(["login", "--server", server.url]) == 1
    assert "sign in with one of --token or --oidc" in capsys.readouterr().err
    assert main(["login", "--server", server.url, "--token", "fl_uma", "--oidc"]) == 1
    capsys.readouterr()
    # This server's SSO is a JWKS file with no public client: --oidc says so, in one line.
    assert main(["login", "--server", server.url, "--oidc"]) == 1
    assert "names no identity provider with a CLI client" in capsys.readouterr().err
    assert not contexts.exists()


@pytest.mark.parametrize(
    ("argv", "allowed"),
    [
        (["quota", "set", "acme", "--gpus", "8"], {"ops"}),
        (["cluster", "cordon", "us-east-a", "--reason", "r"], {"ops"}),
        (["cluster", "uncordon", "us-east-a"], {"ops"}),
        (["command", "n1", "CORDON", "--cluster-id", "us-east-a"], {"ops"}),
        (["tickets", "move", "t-1", "IN_REPAIR"], {"ops"}),
        (["energy", "apply", "ENERGY"], {"ops"}),
        (["apply", "-f", "TRAIN"], {"ops", "uma"}),  # ana's token lacks the second factor
        (["delete", "acme/train"], {"ops", "uma"}),
        (["delete", "dataset:acme/corpus"], {"ops", "uma"}),
    ],
)
def test_every_write_command_is_refused_for_a_role_that_may_not(
    server, contexts, monkeypatch, capsys, argv, allowed
):
    energy = contexts.parent / "energy.yaml"
    energy.write_text(
        yaml.safe_dump(
            [{"cluster_id": "us-east-a", "price_per_kwh": [0.1] * 24, "renewable_share": [0] * 24}]
        )
    )
    train = contexts.parent / "train.yaml"
    train.write_text(TRAIN)
    argv = [{"ENERGY": str(energy), "TRAIN": str(train)}.get(a, a) for a in argv]
    monkeypatch.setenv("FLEETLINE_SERVER", server.url)
    for subject in PRINCIPALS:
        monkeypatch.setenv("FLEETLINE_TOKEN", f"fl_{subject}")
        code = main(argv)
        # The last line is the command's (the server in this process logs its refusals too).
        err = capsys.readouterr().err.splitlines()[-1:] or [""]
        err = err[0]
        if subject in allowed:
            # Past the guard: done (0), or refused by what the call names (no such ticket,
            # job or operations port on this test server), never for who asked.
            assert code != 77, (subject, argv, err)
        else:
            assert code == 77, (subject, argv, code, err)
            assert err.startswith("fleetline: refused: "), err
    # The server audited every refusal with who asked, not a name typed on the command line.
    refused = {e["actor"] for e in server.recorder.events if e["outcome"] in ("DENIED",)}
    assert refused >= set(PRINCIPALS) - allowed - {"ana"}


def test_another_tenant_and_an_admin_session_without_a_second_factor_are_refused(
    server, contexts, monkeypatch, capsys
):
    spec = contexts.parent / "globex.yaml"
    spec.write_text(TRAIN.replace("tenant: acme", "tenant: globex"))
    monkeypatch.setenv("FLEETLINE_SERVER", server.url)
    monkeypatch.setenv("FLEETLINE_TOKEN", "fl_uma")
    assert main(["apply", "-f", str(spec)]) == 77
    assert "uma may only submit for tenant acme, the specs name globex" in capsys.readouterr().err
    assert main(["delete", "globex/train"]) == 77
    assert "uma may only reach tenant acme" in capsys.readouterr().err
    # A tenant admin signing in through SSO: without MFA refused, with it admitted.
    plain = sso_token(sub="ana", fleetline_role="tenant-admin", amr=["pwd"])
    monkeypatch.setenv("FLEETLINE_TOKEN", plain)
    assert main(["delete", "acme/train"]) == 77
    err = capsys.readouterr().err
    assert "role tenant-admin requires a second factor" in err and plain not in err
    train = contexts.parent / "train.yaml"
    train.write_text(TRAIN)
    monkeypatch.setenv("FLEETLINE_TOKEN", "fl_ana")  # an API token carries no second factor
    assert main(["apply", "-f", str(train)]) == 77
    assert "an API token carries none" in capsys.readouterr().err
    strong = sso_token(sub="ana", fleetline_role="tenant-admin", amr=["pwd", "mfa"])
    monkeypatch.setenv("FLEETLINE_TOKEN", strong)
    assert main(["apply", "-f", str(train)]) == 0
    assert "acme/train: submitted" in capsys.readouterr().out
    assert [r["actor"] for r in server.port.requests if r["key"] == "acme/train"][-1] == "ana"
