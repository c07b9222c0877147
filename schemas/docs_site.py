"""Where the documentation is read: the project's ``Documentation`` URL (``pyproject.toml``'s ``[project.urls]``).

Help texts and errors name pages by this address, so a user of the wheel, who has no ``docs/`` folder, can open
them. It is read from the installed package's metadata, or from ``pyproject.toml`` in a source checkout that was
not installed.
"""

from __future__ import annotations

import tomllib
from functools import cache
from importlib import metadata
from pathlib import Path


@cache
def site() -> str:
    """The documentation site's address, ending in ``/``."""
    try:
        entries = metadata.metadata("rlstage").get_all("Project-URL") or []
    except metadata.PackageNotFoundError:
        entries = []
    urls = {label.strip().lower(): url.strip() for label, _, url in (e.partition(",") for e in entries)}
    if "documentation" not in urls:
        pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
        urls = {k.lower(): v for k, v in tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]["urls"].items()}
    return urls["documentation"].rstrip("/") + "/"


def page_url(page: str, anchor: str = "") -> str:
    """The address of a docs page (``reference/config.md``, ``docs/usage.md``) as mkdocs serves it (a folder a page)."""
    path = page.removeprefix("docs/").removesuffix(".md")
    path = "" if path == "index" else f"{path}/"
    return site() + path + (f"#{anchor}" if anchor else "")
