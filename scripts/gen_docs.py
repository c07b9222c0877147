"""Derive docs/reference/config.md from the config models: every section and field, its type, default and
help (the field's description, else the comment written beside or above it in schemas/config/); the registries'
page from the registries; the invariants' page from the tests' ``@pytest.mark.invariant(name, tolerance)`` marks.

    .venv/bin/python scripts/gen_docs.py           # rewrite the page
    .venv/bin/python scripts/gen_docs.py --check   # exit 1 when the committed page is stale (tests/docs/test_docs.py)
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import sys
from pathlib import Path

from rlstage.schemas.config import RunConfig
from rlstage.schemas.settings_help import is_execution, missing_help, read_by, rows, sections, type_name  # noqa: F401

PAGE = Path(__file__).resolve().parent.parent / "docs" / "reference" / "config.md"
REGISTRIES_PAGE = PAGE.parent / "registries.md"
INVARIANTS_PAGE = PAGE.parent / "invariants.md"
TESTS = PAGE.parent.parent.parent / "tests"
# The modules whose import registers the built-in entries of every registry.
BUILTINS = (
    "rlstage.engines.algorithms", "rlstage.engines.data.datasets", "rlstage.engines.rollout.engines",
    "rlstage.engines.rewards.rules", "rlstage.engines.agents.tools",
)  # fmt: skip
def render() -> str:
    lines = [
        "# Configuration reference",
        "",
        "Generated from the config models (`schemas/config/`) by `scripts/gen_docs.py`; do not edit by hand.",
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
        if prefix:
            lines += [f'<a id="{prefix.rstrip(".")}"></a>', ""]
        if doc and not doc.startswith(("Usage docs", "A base class")):
            lines += [" ".join(doc.split("\n\n")[0].split()), ""]  # its first paragraph, whole
        lines += ["| field | type | default | read by | help |", "| --- | --- | --- | --- | --- |"]
        for name, field, text in by_section.get(prefix, []):
            default = "required" if field.is_required() else repr(field.get_default(call_default_factory=True))
            kind = type_name(field.annotation).replace("|", "\\|")
            path = f"{prefix}{name}"
            stages = "every stage (never hashed)" if is_execution(path) else ", ".join(read_by(path)) or "the flow (no stage input)"
            anchor = f'<a id="{path}"></a>'  # the link a config error naming the setting prints
            lines.append(f"| {anchor}`{path}` | `{kind}` | `{default}` | {stages} | {text.replace('|', chr(92) + '|')} |")
    return "\n".join(lines) + "\n"


def _trait(value: object) -> str:
    """A trait's value as a table cell: a tuple of names as a comma-separated list."""
    return ", ".join(map(str, value)) if isinstance(value, tuple) else str(value)


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def render_registries() -> str:
    """Every registry's built-in entries: name, what each needs, its settings (with defaults and help), its doc."""
    import importlib

    from rlstage.engines.registry import NAMED_SETTINGS, REGISTRIES

    for module in BUILTINS:
        importlib.import_module(module)
    named_by: dict[str, list[str]] = {}
    for setting, kind in NAMED_SETTINGS.items():
        named_by.setdefault(kind, []).append(f"`{setting}`")
    lines = [
        "# Registries",
        "",
        "Generated from the registries (`rlstage.engines.registry`) by `scripts/gen_docs.py`; do not edit by hand.",
        "A config names an entry by a plain string, checked when it loads; *needs* is what the run must then have",
        "(a critic, groups of `rollout.n >= 2`, a reference policy, the sum of pi squared); *settings* sit beside the",
        "name in the config, *(flat)* ones in the section that names it (verl's `algorithm.gamma`, `actor.loss_scale_factor`),",
        "and *italics* are what a rollout engine declares about itself. Plugins add entries",
        "([Registries and plugins](../algorithms.md#registries-and-plugins)).",
    ]
    for kind, registry in REGISTRIES.items():
        lines += ["", f"## {kind}", ""]
        if kind in named_by:
            lines += [f"Named by {', '.join(named_by[kind])}.", ""]
        lines += ["| name | needs | settings | what it is |", "| --- | --- | --- | --- |"]
        for name in registry:
            entry = registry.entry(name)
            if not entry.module.startswith("rlstage."):
                continue  # a plugin's, present in this environment: not rlstage's documentation
            cells = []
            if entry.settings is not None:
                cells += [
                    f"`{field}` = `{info.get_default(call_default_factory=True)!r}`" if not info.is_required() else f"`{field}` (required)"
                    for field, info in entry.settings.model_fields.items()
                ]
            cells += [f"`{read}` (flat)" for read in sorted(entry.reads)]
            if dataclasses.is_dataclass(entry.traits):  # what the entry declares about itself, where not the default
                default = type(entry.traits)()
                cells += [
                    f"*{f.name}*" if value is True or callable(value) else f"*{f.name}* = `{_trait(value)}`"
                    for f in dataclasses.fields(entry.traits)
                    if (value := getattr(entry.traits, f.name)) != getattr(default, f.name) and f.name != "install"
                ]
            settings = "<br>".join(cells)
            doc = (inspect.getdoc(entry.obj) or "").split("\n\n")[0]
            lines.append(f"| `{name}` | {', '.join(sorted(entry.needs)) or ''} | {settings} | {_cell(doc)} |")
    return "\n".join(lines) + "\n"


def invariants(tests: Path = TESTS) -> list[tuple[str, str, str]]:
    """(invariant, tolerance, test id) of every test marked ``@pytest.mark.invariant("a == b", "tolerance")``, read
    from the test files' source (nothing is imported)."""
    out = []
    for path in sorted(tests.rglob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.FunctionDef):
                continue
            for d in node.decorator_list:
                if isinstance(d, ast.Call) and ast.unparse(d.func) == "pytest.mark.invariant":
                    name, tolerance = (ast.literal_eval(a) for a in d.args)
                    out.append((name, tolerance, f"{path.relative_to(tests.parent)}::{node.name}"))
    return sorted(out)


def render_invariants() -> str:
    lines = [
        "# Invariants",
        "",
        "Generated from the tests' `@pytest.mark.invariant` marks by `scripts/gen_docs.py`; do not edit by hand.",
        "The equalities rlstage guarantees: two ways to compute the same thing (a new path and the old one, one",
        "process and two, a run and its replay) that must agree, each asserted on the tiny kit within the tolerance",
        "given. `bash scripts/test.sh -m invariant` runs exactly these; those under `tests/integration/` start Ray,",
        "Prefect or an engine.",
        "",
        "| invariant | within | test |",
        "| --- | --- | --- |",
    ]
    for name, tolerance, test in invariants():
        lines.append(f"| {_cell(name)} | {_cell(tolerance)} | `{test}` |")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    pages = {PAGE: render(), REGISTRIES_PAGE: render_registries(), INVARIANTS_PAGE: render_invariants()}
    if "--check" in argv:
        stale = [page for page, text in pages.items() if not page.is_file() or page.read_text() != text]
        for page in stale:
            print(f"{page} is stale: run .venv/bin/python scripts/gen_docs.py", file=sys.stderr)
        return 1 if stale else 0
    for page, text in pages.items():
        page.parent.mkdir(parents=True, exist_ok=True)
        page.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
