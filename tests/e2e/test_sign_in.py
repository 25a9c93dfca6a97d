"""Signing in as enterprises do, against a real OpenID provider (node-oidc-provider, started on
loopback by fleetline/infra/oidc.py) and a real browser (Debian's Chromium via Playwright):

- the console signs in through the provider with authorization code + PKCE, no pasted token;
- an admin role is refused without the second factor and admitted with it (`amr`);
- `fleetline login --oidc` signs the CLI in the same way, through a loopback redirect;
- the provider's signing key rolls over (published, then signing, then the old one retired)
  and the running API follows without a restart: a token by the new key verifies, one by the
  retired key is refused.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.error import HTTPError
from urllib.request import Request, urlopen

import jwt
import pytest
import yaml
from playwright.sync_api import Page

from fleetline.api.app import create_app
from fleetline.api.auth import AuthConfig, Authenticator
from fleetline.cli import main
from fleetline.infra.oidc import CLI_CLIENT, CONSOLE_CLIENT, IdentityProvider, IdentityUser
from fleetline.processors.view.read import StaticView
from tests.fleet_events import fold
from tests.services import free_port, serving
from tests.support import Recorder, wait_until
from tests.unit.test_api import SchedulerPort

REFRESH_S = 2  # how often the API reads the provider's keys again
USERS = {
    "uma": IdentityUser("uma-password", "user", "acme"),
    "ana": IdentityUser("ana-password", "tenant-admin", "acme", otp="246810"),
}


@dataclass
class Deployment:
    api: str
    idp: IdentityProvider


@pytest.fixture(scope="module")
def deployment(tmp_path_factory) -> Iterator[Deployment]:
    idp = IdentityProvider(tmp_path_factory.mktemp("idp"), free_port(), USERS)
    config = {
        "jwt": {
            "issuer": idp.issuer,
            "discovery": True,
            "refresh_s": REFRESH_S,
            "audience": [CONSOLE_CLIENT, CLI_CLIENT],
            "console_client": CONSOLE_CLIENT,
            "cli_client": CLI_CLIENT,
        },
        "require_mfa": ["platform-admin", "tenant-admin"],
    }
    app = create_app(
        StaticView(fold([])),
        Authenticator(AuthConfig.from_data(config)),
        Recorder(),
        jobs=SchedulerPort(),
        signals=lambda record: 0,
        commands=lambda record: 0,
    )
    with serving(app) as url:
        idp.console_redirects = [f"{url}/ui/"]
        idp.start()
        try:
            yield Deployment(url, idp)
        finally:
            idp.wipe()


@pytest.fixture
def page(browser) -> Iterator[Page]:
    context = browser.new_context()  # a browser of its own: no provider session carried over
    try:
        yield context.new_page()
    finally:
        context.close()


def sign_in_at_provider(page: Page, user: str, otp: str = "") -> None:
    page.wait_for_selector("input[name=username]", timeout=20_000)
    page.fill("input[name=username]", user)
    page.fill("input[name=password]", USERS[user].password)
    page.fill("input[name=otp]", otp)
    page.click("button[type=submit]")


def me(api: str, token: str) -> tuple[int, Any]:
    request = Request(f"{api}/v1/me", headers={"Authorization": f"Bearer {token}"})
    try:
        with urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except HTTPError as exc:
        return exc.code, json.loads(exc.read())


def claims(token: str) -> dict[str, Any]:
    return dict(jwt.decode(token, options={"verify_signature": False}))


def header(token: str) -> dict[str, Any]:
    return dict(jwt.get_unverified_header(token))


def console_sign_in(page: Page, deployment: Deployment, user: str, otp: str = "") -> None:
    page.goto(f"{deployment.api}/ui/")
    page.click("#sso")
    assert page.url.startswith(deployment.idp.issuer), page.url
    sign_in_at_provider(page, user, otp)
    page.wait_for_url(f"{deployment.api}/ui/**", timeout=20_000)


def test_the_console_signs_in_through_the_provider_with_pkce(deployment, page):
    console_sign_in(page, deployment, "uma")
    page.wait_for_function("document.querySelector('#who').textContent.length > 0")
    assert page.inner_text("#who") == "uma · user · acme"
    token = page.evaluate("sessionStorage.getItem('fleetline.token')")
    assert claims(token)["amr"] == ["pwd"] and claims(token)["aud"] == CONSOLE_CLIENT
    # The code and state left the address bar; the PKCE verifier left the session.
    assert "code=" not in page.url
    assert page.evaluate("sessionStorage.getItem('fleetline.sign-in')") is None


def test_an_admin_is_refused_without_the_second_factor_and_admitted_with_it(deployment, browser):
    without = browser.new_context()
    try:
        page = without.new_page()
        console_sign_in(page, deployment, "ana")
        page.wait_for_function("document.querySelector('#login-error').textContent.length > 0")
        assert "second factor" in page.inner_text("#login-error")
        assert page.is_visible("#login") and page.inner_text("#who") == ""
    finally:
        without.close()
    with_otp = browser.new_context()
    try:
        page = with_otp.new_page()
        console_sign_in(page, deployment, "ana", otp=USERS["ana"].otp or "")
        page.wait_for_function("document.querySelector('#who').textContent.length > 0")
        assert page.inner_text("#who") == "ana · tenant-admin · acme"
    finally:
        with_otp.close()


def test_a_wrong_one_time_code_is_refused_at_the_provider(deployment, page):
    page.goto(f"{deployment.api}/ui/")
    page.click("#sso")
    sign_in_at_provider(page, "ana", otp="000000")
    page.wait_for_selector("#error:has-text('Wrong one-time code')", timeout=10_000)
    assert page.url.startswith(deployment.idp.issuer)


def cli_login(deployment: Deployment, page: Page, user: str, monkeypatch, tmp_path) -> str:
    """`fleetline login --oidc` in a thread, its browser step done in `page`: the token the
    context keeps."""
    contexts = tmp_path / "contexts.yaml"
    monkeypatch.setenv("FLEETLINE_CONTEXTS", str(contexts))
    opened: queue.Queue[str] = queue.Queue()
    monkeypatch.setattr("webbrowser.open", lambda url: opened.put(url) or True)
    codes: list[int] = []
    login = threading.Thread(
        target=lambda: codes.append(
            main(["login", "--server", deployment.api, "--oidc", "--name", "sso"])
        )
    )
    login.start()
    page.goto(opened.get(timeout=30))
    sign_in_at_provider(page, user)
    # The provider asks which native application signs in (any program can listen on loopback).
    page.click("#allow", timeout=20_000)
    try:
        page.wait_for_url("**/callback?**", timeout=20_000)
    except Exception:
        raise AssertionError(f"no redirect to the CLI: {page.url} {page.content()[:800]}") from None
    login.join(30)
    assert codes == [0] and "done" in page.inner_text("#result")
    saved = yaml.safe_load(contexts.read_text())
    assert saved["current"] == "sso"
    return str(saved["contexts"]["sso"]["token"])


def test_the_cli_signs_in_through_the_provider(deployment, page, monkeypatch, tmp_path):
    token = cli_login(deployment, page, "uma", monkeypatch, tmp_path)
    assert claims(token)["aud"] == CLI_CLIENT
    status, who = me(deployment.api, token)
    assert status == 200 and (who["subject"], who["role"], who["tenant"]) == ("uma", "user", "acme")


def test_the_provider_s_key_rotates_without_restarting_the_api(
    deployment, browser, monkeypatch, tmp_path
):
    def fresh_token(name: str) -> str:
        context = browser.new_context()
        try:
            return cli_login(deployment, context.new_page(), "uma", monkeypatch, tmp_path / name)
        finally:
            context.close()

    before = fresh_token("before")
    assert me(deployment.api, before)[0] == 200
    old_kid = header(before)["kid"]
    # A rollover: the new key is published first; the API, not restarted, reads the provider's
    # keys again within its refresh (2 s here) whenever a token is checked.
    new_kid = deployment.idp.publish_next_key()
    time.sleep(REFRESH_S + 0.5)
    assert me(deployment.api, before)[0] == 200  # the check that reads the keys again
    deployment.idp.sign_with_next_key()
    after = fresh_token("after")
    assert header(after)["kid"] == new_kid != old_kid
    assert me(deployment.api, after)[0] == 200
    assert me(deployment.api, before)[0] == 200  # the old key is still published
    deployment.idp.retire()
    wait_until(lambda: me(deployment.api, before)[0] == 401, 20, "the retired key to be refused")
    assert "no signing key" in me(deployment.api, before)[1]["detail"]
    assert me(deployment.api, after)[0] == 200
