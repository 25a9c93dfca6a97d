"""What every benchmark script shares: the local services and the results file."""

from __future__ import annotations

import contextlib
import json
import platform
from collections.abc import Iterator
from pathlib import Path

from fleetline.config import Settings
from fleetline.infra import LocalServices

RESULTS_DIR = Path(__file__).resolve().parent / "results"


@contextlib.contextmanager
def local_services(settings: Settings) -> Iterator[None]:
    """Use the configured broker and S3 server, starting (then stopping) them if they are down."""
    services = LocalServices.from_settings(settings)
    started = not all(services.status().values())
    if started:
        services.start()
    try:
        yield
    finally:
        if started:
            services.stop()


def report(name: str, figures: dict[str, object]) -> None:
    rounded = {k: round(v, 3) if isinstance(v, float) else v for k, v in figures.items()}
    full = {
        "machine": f"{platform.machine()} {platform.python_implementation()} "
        f"{platform.python_version()}",
        **rounded,
    }
    for key, value in full.items():
        print(f"{key:44} {value}")
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    path.write_text(json.dumps(full, indent=2) + "\n")
    print(f"written to {path}")
