"""Named registries: what a config may name (estimators, policy losses, aggregation modes, KL penalties, ...).

Design (issue #35, open registries). A config names an entry as a plain string; ``schemas/`` is a leaf that may
not import the registries, so it keeps the name as given and engines/preflight.py checks it here at load time
(``config error: <setting>: unknown <kind> 'x'; registered: ...``). Each entry declares once what it needs
(``critic``, ``groups``, ``sum_pi_squared``, ``ref``) and, where it has settings, their pydantic model: the
config holds those settings as a permissive nested section (``actor.policy_loss: {name: gspo, clip_ratio_low:
0.2}``) and ``settings_for`` validates them against the entry's model, so a plugin's settings are typed without
schemas knowing the plugin. A stage view that depends on what an entry needs (``schemas.stages.NeedRead``) is given
``needs_of`` by its caller (tasks/, flows/): schemas asks nothing of the engines. Third-party entries come from plugins
(engines/plugins.py), which register through the same decorators; two registrations of one name are refused.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from pydantic import BaseModel, ValidationError

T = TypeVar("T")

# The needs an entry may declare: the run then configures (or checks for) that piece. "kit": a data source built
# from the tiny kit's settings (kit.*), which its data prep then reads.
NEEDS = frozenset({"critic", "groups", "sum_pi_squared", "ref", "kit"})


class DuplicateEntry(ValueError):
    """Two registrations of one name (two plugins, or a plugin and a built-in): one line naming both."""


@dataclass(frozen=True)
class Entry(Generic[T]):
    name: str
    obj: T
    needs: frozenset[str] = frozenset()
    settings: type[BaseModel] | None = None  # the model of its nested settings; None: it takes none
    module: str = ""  # where it was registered: a plugin's module names its distribution (engines/plugins.py)
    # the flat settings of its config section it reads (an estimator's algorithm.gamma, ...): another value of one it
    # does not read is refused at load, as a nested setting it does not take is
    reads: frozenset[str] = frozenset()
    traits: Any = None  # what its registry records about it, typed by that registry (a rollout engine's EngineTraits)


def _origin(obj: Any) -> str:
    return getattr(obj, "__module__", None) or type(obj).__module__


class Registry(Mapping[str, T]):
    """Entries by name; ``registry[name]`` is the registered object, ``registry.entry(name)`` its record."""

    def __init__(self, kind: str) -> None:
        self.kind = kind  # in messages: "policy loss", "advantage estimator", ...
        self._entries: dict[str, Entry[T]] = {}
        REGISTRIES[kind] = self

    def add(
        self,
        name: str,
        obj: T,
        *,
        needs: Iterable[str] = (),
        settings: type[BaseModel] | None = None,
        module: str | None = None,
        reads: Iterable[str] = (),
        traits: Any = None,
    ) -> Entry[T]:
        unknown = set(needs) - NEEDS
        if unknown:
            raise ValueError(
                f"{self.kind} {name!r} declares unknown needs {sorted(unknown)}; known: {sorted(NEEDS)}"
            )
        entry = Entry(name, obj, frozenset(needs), settings, module or _origin(obj), frozenset(reads), traits)
        old = self._entries.get(name)
        # the same object (a decorator stacked twice, a module imported again) is not a second registration
        if (
            old is not None
            and old.obj is not obj
            and (old.module, _qualname(old.obj)) != (entry.module, _qualname(obj))
        ):
            raise DuplicateEntry(
                f"{self.kind} {name!r} is registered twice: by {old.module} and by {entry.module}"
            )
        self._entries[name] = entry
        return entry

    def register(
        self,
        name: str,
        *,
        needs: Iterable[str] = (),
        settings: type[BaseModel] | None = None,
        reads: Iterable[str] | Callable[[T], Iterable[str]] = (),
        traits: Any = None,
    ) -> Callable[[T], T]:
        """Decorator form of ``add``; ``reads`` may be a function of the registered object (e.g. of its signature)."""

        def deco(obj: T) -> T:
            self.add(name, obj, needs=needs, settings=settings, reads=reads(obj) if callable(reads) else reads, traits=traits)
            return obj

        return deco

    def entry(self, name: str) -> Entry[T]:
        if name not in self._entries:
            raise ValueError(f"unknown {self.kind} {name!r}; registered: {', '.join(self._entries)}")
        return self._entries[name]

    def remove(self, name: str) -> None:
        """Forget an entry (tests that register one for themselves)."""
        del self._entries[name]

    def __getitem__(self, name: str) -> T:
        return self._entries[name].obj

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}: {', '.join(self._entries)})"


def _qualname(obj: Any) -> str:
    return getattr(obj, "__qualname__", repr(obj))


REGISTRIES: dict[str, Registry] = {}

# The config settings that name an entry, and the registry each is looked up in (declared once: preflight checks
# them, a run records and the stage cache keys hash the plugin versions of the entries they name).
ALGORITHM_SETTINGS: dict[str, str] = {
    "algorithm.adv_estimator": "advantage estimator",
    "actor.policy_loss": "policy loss",
    "actor.loss_agg_mode": "loss aggregation mode",
    "critic.loss_agg_mode": "loss aggregation mode",
    "actor.kl_loss_type": "KL penalty",
    "algorithm.kl_penalty": "KL penalty",
}
# Checked by engines/preflight.py (reward.function too takes an import path, or None: engines/rewards/rules.py checks it).
CHECKED_SETTINGS: dict[str, str] = {**ALGORITHM_SETTINGS, "data.source": "data source", "rollout.engine": "rollout engine"}
# agent.tools: a list, each tool's callable a registered name or an import path (engines/agents/tools.py checks them)
NAMED_SETTINGS: dict[str, str] = {
    **CHECKED_SETTINGS,
    "reward.function": "reward function",
    "agent.tools": "tool",
}


def named_values(cfg: Any, setting: str) -> list[str]:
    """The entry names a config (or a view of it) gives ``setting``: a string, a nested section's ``name``, or each
    tool's ``callable``; none where it names no entry (unset, or an import path ``module:function``)."""
    node = cfg
    for part in setting.split("."):
        node = getattr(node, part)
    items = node if isinstance(node, list) else [node]
    names = [getattr(item, "callable", None) or getattr(item, "name", item) for item in items]
    names = [n for n in names if isinstance(n, str)]
    if (
        setting not in CHECKED_SETTINGS
    ):  # reward.function and tools also take import paths, which name no entry
        names = [n for n in names if ":" not in n and (setting == "reward.function" or "." not in n)]
    return names


def settings_for(entry: Entry, given: Mapping[str, Any], where: str) -> BaseModel | None:
    """The entry's typed settings from the config's nested section ``given`` (its ``name`` left out); ValueError
    with one line naming ``where`` (e.g. ``actor.policy_loss``) and the setting when the model rejects them."""
    if entry.settings is None:
        if given:
            raise ValueError(f"{where}.{next(iter(given))}: {entry.name} takes no settings")
        return None
    fields = entry.settings.model_fields
    unknown = [key for key in given if key not in fields]
    if unknown:  # refused whatever the model's own extra= says: a misspelt setting would be silently dropped
        raise ValueError(
            f"{where}.{unknown[0]}: {entry.name} takes no {unknown[0]} (its settings: {', '.join(fields) or 'none'})"
        )
    try:
        return entry.settings.model_validate(dict(given))
    except ValidationError as err:
        first = err.errors()[0]
        loc = ".".join(str(p) for p in first["loc"])
        msg = first["msg"].removeprefix("Value error, ")
        raise ValueError(f"{where}.{loc}: {msg}") from None


def needs_of(kind: str, name: str) -> frozenset[str]:
    """What entry ``name`` of registry ``kind`` needs (the callers of the stage views pass it: ``schemas.stages.NeedRead``)."""
    return REGISTRIES[kind].entry(name).needs


def check_flat_reads(entry: Entry, section: BaseModel, flat: Sequence[str], where: str) -> None:
    """ValueError (one line naming ``where.<setting>``) when one of the ``flat`` settings of ``section`` (the config
    section holding them beside the entry's name, at ``where``) differs from its default though the entry does not
    read it (``Entry.reads``): a setting that would be silently ignored, as a nested one it does not take is refused."""
    fields = type(section).model_fields
    for key in flat:
        if key not in entry.reads and getattr(section, key) != fields[key].get_default(call_default_factory=True):
            its = [k for k in flat if k in entry.reads] + list(entry.settings.model_fields if entry.settings else ())
            raise ValueError(f"{where}.{key}: {entry.name} takes no {key} (its settings: {', '.join(its) or 'none'})")
