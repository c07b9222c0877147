"""Derive docs/reference/config.md from the config models: every section and field, its type, default and
help (the field's description, else the comment written beside or above it in schemas/config.py).

    .venv/bin/python scripts/gen_docs.py           # rewrite the page
    .venv/bin/python scripts/gen_docs.py --check   # exit 1 when the committed page is stale (tests/test_docs.py)
"""

from __future__ import annotations

import inspect
import re
import sys
import typing
from pathlib import Path

from pydantic import BaseModel

from rlstage.schemas.config import RunConfig

PAGE = Path(__file__).resolve().parent.parent / "docs" / "reference" / "config.md"
FIELD = re.compile(r"^    (\w+): [^=]+?(?:=.*)?$")


def comments(cls: type) -> dict[str, str]:
    """Field name -> the comment lines directly above its declaration plus its inline comment."""
    out: dict[str, str] = {}
    above: list[str] = []
    for line in inspect.getsource(cls).splitlines():
        stripped = line.strip()
        if line.startswith("    # "):
            above.append(stripped[2:])
            continue
        m = FIELD.match(line.split("  # ")[0].rstrip())
        if m and not stripped.startswith(("def ", "@", "return", "class ")):
            inline = line.split("  # ", 1)[1].strip() if "  # " in line else ""
            out[m.group(1)] = " ".join([*above, inline]).strip()
        above = []
    return out


def type_name(annotation) -> str:
    text = getattr(annotation, "__name__", None) if typing.get_origin(annotation) is None else None
    return text or str(annotation).replace("typing.", "")


def sections(model: type[BaseModel], prefix: str = "") -> list[tuple[str, type[BaseModel]]]:
    found = [(prefix, model)]
    for name, field in model.model_fields.items():
        sub = field.annotation
        if isinstance(sub, type) and issubclass(sub, BaseModel):
            found += sections(sub, f"{prefix}{name}.")
    return found


def rows() -> list[tuple[str, type[BaseModel], str, object, str]]:
    """(section prefix, section model, field name, field info, help) for every leaf setting of ``RunConfig``."""
    out = []
    for prefix, model in sections(RunConfig):
        helps: dict[str, str] = {}
        for klass in reversed(model.__mro__):
            if isinstance(klass, type) and issubclass(klass, BaseModel) and klass.__module__ == model.__module__:
                helps |= comments(klass)
        for name, field in model.model_fields.items():
            sub = field.annotation
            if not (isinstance(sub, type) and issubclass(sub, BaseModel)):
                out.append((prefix, model, name, field, field.description or helps.get(name, "")))
    return out


def missing_help() -> list[str]:
    """Settings with neither a description nor a comment in schemas/config.py (tests/test_docs.py fails on any)."""
    return [f"{prefix}{name}" for prefix, _, name, _, text in rows() if not text]


def render() -> str:
    lines = [
        "# Configuration reference",
        "",
        "Generated from the config models (`schemas/config.py`) by `scripts/gen_docs.py`; do not edit by hand.",
        "A run's config is one YAML file plus dotted overrides (`actor.optim.lr=2e-4`); an unknown key or a bad",
        "value is refused in one line naming it.",
    ]
    by_section: dict[str, list] = {}
    for prefix, _, name, field, text in rows():
        by_section.setdefault(prefix, []).append((name, field, text))
    for prefix, model in sections(RunConfig):
        doc = inspect.getdoc(model) if model.__doc__ else ""
        lines += ["", f"## `{prefix.rstrip('.') or 'top level'}`", ""]
        if doc and not doc.startswith(("Usage docs", "A base class")):
            lines += [doc.splitlines()[0], ""]
        lines += ["| field | type | default | help |", "| --- | --- | --- | --- |"]
        for name, field, text in by_section.get(prefix, []):
            default = "required" if field.is_required() else repr(field.get_default(call_default_factory=True))
            kind = type_name(field.annotation).replace("|", "\\|")
            lines.append(f"| `{prefix}{name}` | `{kind}` | `{default}` | {text.replace('|', chr(92) + '|')} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        if not PAGE.is_file() or PAGE.read_text() != text:
            print(f"{PAGE} is stale: run .venv/bin/python scripts/gen_docs.py", file=sys.stderr)
            return 1
        return 0
    PAGE.parent.mkdir(parents=True, exist_ok=True)
    PAGE.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
