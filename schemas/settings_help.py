"""Each config setting's help, declared once: the field's description, else the comment written beside or above
it in the config modules (schemas/config/). The configuration reference (scripts/gen_docs.py) and ``rlstage init`` are derived from it."""

from __future__ import annotations

import functools
import inspect
import re
import typing

from pydantic import BaseModel

from rlstage.schemas.config import RunConfig
from rlstage.schemas.docs_site import page_url
from rlstage.schemas.stages import EXECUTION, SPECS

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
    # a section model by the name it is imported under (rlstage.schemas.config.X), not its module's
    return text or re.sub(r"rlstage\.schemas\.config\.\w+\.", "rlstage.schemas.config.", str(annotation).replace("typing.", ""))


def sections(model: type[BaseModel], prefix: str = "") -> list[tuple[str, type[BaseModel]]]:
    found = [(prefix, model)]
    for name, field in model.model_fields.items():
        sub = field.annotation
        if isinstance(sub, type) and issubclass(sub, BaseModel):
            found += sections(sub, f"{prefix}{name}.")
    return found


@functools.cache
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


@functools.cache
def setting_paths() -> frozenset[str]:
    """Every setting's dotted path and every section's (a section: its table), without the help texts, whose
    reading parses the config module's source (a second of a config error's one line)."""
    found = set()
    for prefix, model in sections(RunConfig):
        found.add(prefix.rstrip("."))
        found |= {f"{prefix}{name}" for name in model.model_fields}
    return frozenset(found - {""})


def missing_help() -> list[str]:
    """Settings with neither a description nor a comment in schemas/config/ (tests/docs/test_docs.py fails on any)."""
    return [f"{prefix}{name}" for prefix, _, name, _, text in rows() if not text]


class _AnySettings:
    """A config view under which every condition holds: a stage's ``reads_if`` then names all it may read."""

    def __getattr__(self, name: str) -> _AnySettings:
        return self

    def __bool__(self) -> bool:
        return True

    def __eq__(self, other: object) -> bool:
        return True

    __gt__ = __ge__ = __lt__ = __le__ = __ne__ = __eq__
    __hash__ = object.__hash__


def _covers(reads: tuple[str, ...], path: str) -> bool:
    return any(path == r or path.startswith(r + ".") for r in reads)


def read_by(path: str) -> list[str]:
    """The stages whose declared reads cover the dotted setting ``path`` (a section read covers its fields); one
    that reads it only under some settings (its ``reads_if``) is marked so."""
    out = []
    for s in SPECS:
        if _covers(s.reads, path):
            out.append(s.name)
            continue
        try:
            some = s.reads_if(_AnySettings()) if s.reads_if is not None else ()
        except Exception:  # a condition that asks a registry about the stub: not derivable here
            some = ()
        some = (*some, *(p for r in s.reads_if_needs for p in r.paths))
        if _covers(tuple(some), path):
            out.append(f"{s.name} (some settings)")
    return out


def is_execution(path: str) -> bool:
    """Where and how a run executes (never hashed into a stage's key): every stage may read it."""
    return path.split(".", 1)[0] in EXECUTION


def help_of(path: str) -> str:
    """The help text of the dotted setting ``path``; of a section (a named entry, ``algorithm.adv_estimator``, which a
    config may give as its plain name) the help beside the field that holds it."""
    for prefix, _, name, _, text in rows():
        if f"{prefix}{name}" == path:
            return text
    parent, _, name = path.rpartition(".")
    for prefix, model in sections(RunConfig):
        if prefix.rstrip(".") == parent and name in model.model_fields:
            return model.model_fields[name].description or comments(model).get(name, "")
    raise KeyError(path)


REFERENCE = "reference/config.md"  # a docs page, linked on the documentation site (schemas/docs_site.py)
_NAMED = re.compile(r"^config error: ([A-Za-z_][\w.\[\]]*):")


def reference_link(message: str) -> str | None:
    """Where the configuration reference explains the setting a ``config error: <setting>: ...`` line names (the
    longest setting path the named key starts with), or None when it names none."""
    m = _NAMED.match(message)
    if m is None:
        return None
    key = m.group(1).replace("[", ".").replace("]", "")
    known = setting_paths()
    parts = key.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in known:
            return page_url(REFERENCE, ".".join(parts[:end]))
    return None
