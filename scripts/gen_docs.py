"""Derive docs/reference/config.md from the config models: every section and field, its type, default and
help (the field's description, else the comment written beside or above it in schemas/config.py).

    .venv/bin/python scripts/gen_docs.py           # rewrite the page
    .venv/bin/python scripts/gen_docs.py --check   # exit 1 when the committed page is stale (tests/test_docs.py)
"""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

from rlstage.schemas.config import RunConfig
from rlstage.schemas.settings_help import is_execution, missing_help, read_by, rows, sections, type_name  # noqa: F401

PAGE = Path(__file__).resolve().parent.parent / "docs" / "reference" / "config.md"
def render() -> str:
    lines = [
        "# Configuration reference",
        "",
        "Generated from the config models (`schemas/config.py`) by `scripts/gen_docs.py`; do not edit by hand.",
        "A run's config is one YAML file plus dotted overrides (`actor.optim.lr=2e-4`); an unknown key or a bad",
        "value is refused in one line naming it. *Read by*: the stages whose code reads the setting (from the stage",
        "registry, `schemas/stages.py`): their cache keys hash it, so changing it reruns them and nothing else.",
    ]
    by_section: dict[str, list] = {}
    for prefix, _, name, field, text in rows():
        by_section.setdefault(prefix, []).append((name, field, text))
    for prefix, model in sections(RunConfig):
        doc = inspect.getdoc(model) if model.__doc__ else ""
        lines += ["", f"## `{prefix.rstrip('.') or 'top level'}`", ""]
        if doc and not doc.startswith(("Usage docs", "A base class")):
            lines += [doc.splitlines()[0], ""]
        lines += ["| field | type | default | read by | help |", "| --- | --- | --- | --- | --- |"]
        for name, field, text in by_section.get(prefix, []):
            default = "required" if field.is_required() else repr(field.get_default(call_default_factory=True))
            kind = type_name(field.annotation).replace("|", "\\|")
            path = f"{prefix}{name}"
            stages = "every stage (never hashed)" if is_execution(path) else ", ".join(read_by(path)) or "the flow (no stage input)"
            lines.append(f"| `{path}` | `{kind}` | `{default}` | {stages} | {text.replace('|', chr(92) + '|')} |")
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
