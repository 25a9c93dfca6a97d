"""Writing a postmortem's three files (JSON for tools, Markdown for a ticket, one HTML page)
whole or not at all: each is written beside its final name and moved there once all three
are written."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fleetline.processors.postmortem.render import markdown, page
from fleetline.processors.postmortem.report import canonical


def write(report: Mapping[str, Any], out: Path, title: str) -> dict[str, Path]:
    """`out`.json, .md and .html (out is a path without its suffix); the paths written."""
    out.parent.mkdir(parents=True, exist_ok=True)
    texts = {
        ".json": canonical(report),
        ".md": markdown(report, title),
        ".html": page(report, title),
    }
    staged: dict[str, str] = {}
    try:
        for suffix, text in texts.items():
            fd, name = tempfile.mkstemp(prefix=f".{out.name}", suffix=suffix, dir=out.parent)
            staged[suffix] = name
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
    except BaseException:
        for name in staged.values():
            Path(name).unlink(missing_ok=True)
        raise
    written = {}
    for suffix, name in staged.items():
        final = out.with_name(out.name + suffix)
        os.replace(name, final)
        written[suffix.lstrip(".")] = final
    return written
