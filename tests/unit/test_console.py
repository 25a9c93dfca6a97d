"""The console's static files: served under /ui without a token (they hold no data), nothing
fetched from another host, and the vendored chart library the file the README names."""

from __future__ import annotations

import hashlib
import re

from fastapi.testclient import TestClient

from fleetline.api.app import create_app
from fleetline.api.auth import AuthConfig, Authenticator
from fleetline.api.dashboard import STATIC, UPLOT
from fleetline.processors.view.read import StaticView
from tests.fleet_events import fold
from tests.support import Recorder

# uplot 1.6.32 from the npm registry, dist/uPlot.iife.min.js
UPLOT_SHA256 = "19c8d4c6ad88929a79f4ae49d6f7161566dfd0ba3d15cc495e974f787eb78f1f"


def test_the_console_is_served_without_a_token_and_nothing_comes_from_elsewhere():
    recorder = Recorder()
    client = TestClient(
        create_app(StaticView(fold([])), Authenticator(AuthConfig.from_data({})), recorder)
    )
    home = client.get("/", follow_redirects=False)
    assert home.status_code in (302, 307) and home.headers["location"] == "/ui/"
    page = client.get("/ui/")
    assert page.status_code == 200 and "<title>fleetline</title>" in page.text
    assets = re.findall(r'(?:src|href)="([^"#]+)"', page.text)
    assert UPLOT in assets and "app.js" in assets
    for asset in assets:
        assert not asset.startswith(("http:", "https:", "//")), asset  # no CDN
        if not asset.startswith("data:"):
            assert client.get(f"/ui/{asset}").status_code == 200, asset
    assert client.get("/v1/clusters").status_code == 401  # the data still needs a token
    # Static files are not audited per request; the refused data call is.
    assert [e["target"] for e in recorder.events] == ["/v1/clusters"]


def test_the_vendored_chart_library_is_the_released_file():
    digest = hashlib.sha256((STATIC / UPLOT).read_bytes()).hexdigest()
    assert digest == UPLOT_SHA256
    assert (STATIC / "vendor" / "uplot-LICENSE").read_text().startswith("The MIT License")
