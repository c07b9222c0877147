"""What a command checks before any flow run, Ray or server starts: its inputs, its run, its services.

Everything here imports only light modules (no Prefect, Ray or torch), so the CLI answers a
mistake in about a second, with one line that names the file, setting or service.
"""

from __future__ import annotations

import json
import struct
import urllib.request
from pathlib import Path
from typing import Any

from rlstage.engines.plugins import (
    callables_used,
    check_recorded_callables,
    check_recorded_plugins,
    load_plugins,
    plugins_used,
)
from rlstage.engines.registry import needs_of
from rlstage.infra.store import ArtifactStore
from rlstage.schemas.config import (
    ConfigError,
    RunConfig,
    absolute_root,
    code_settings,
    drop_unset_late_settings,
    parse_overrides,
    stored_config_from,
)
from rlstage.schemas.manifest import Manifest, unsafe_checkpoint_file
from rlstage.schemas.stages import EXECUTION, REPLAYABLE, STAGES, covers, kit_run_name, view_paths

# Fields that may differ between invocations of one run: where and how it executes, and how long
# (unless a stage's view holds the length: a decaying schedule derives its steps from it).
RUN_MUTABLE = (
    *EXECUTION, "trainer.iterations", "trainer.max_actor_ckpt_to_keep", "trainer.keep_checkpoint_every",
    "rollout.weight_sync", "rollout.weight_bucket_mib",  # how weights reach a rollout role, not which
)  # fmt: skip
FIXED = ("run_name", "store")  # a replay or an evaluation may not move the run


class InputError(ValueError):
    """A named input (model folder, data file, service) is missing or unusable: one line naming it."""


# ---------------------------------------------------------------- the run's config


def _registries() -> None:
    """The built-in registry entries and the environment's plugins: the stage views ask what an estimator needs.
    (Imported when first needed: a mistake found before any view is computed is answered without torch.)"""
    from rlstage.engines import algorithms  # noqa: F401  (built-in entries)
    from rlstage.engines.agents import tools  # noqa: F401
    from rlstage.engines.data import datasets  # noqa: F401
    from rlstage.engines.rewards import rules  # noqa: F401
    from rlstage.engines.rollout import engines  # noqa: F401

    load_plugins()


def stage_reads(cfg: RunConfig, path: str) -> bool:
    """Whether some stage's config view holds ``path`` (its output then depends on it)."""
    _registries()
    return any(covers(path, view_paths(cfg, s, needs_of)) for s in STAGES)


def _identity(cfg: RunConfig) -> dict:
    _registries()
    dump = cfg.hashed_dump()
    for path in RUN_MUTABLE:
        if stage_reads(cfg, path):
            continue
        node = dump
        *parents, leaf = path.split(".")
        for p in parents:
            node = node[p]
        node.pop(leaf, None)
    return dump


def _diff(a: dict, b: dict, prefix: str = "") -> list[str]:
    out = []
    for k in sorted(set(a) | set(b)):
        va, vb = a.get(k), b.get(k)
        if isinstance(va, dict) and isinstance(vb, dict):
            out += _diff(va, vb, f"{prefix}{k}.")
        elif va != vb:
            out.append(f"{prefix}{k}: stored {va!r}, given {vb!r}")
    return out


def check_run_config(store: ArtifactStore, cfg: RunConfig) -> bool:
    """Refuse a config that conflicts with the run's recorded one; True when one is recorded."""
    stored = store.get_json(cfg.run_name, "run.json")
    if stored is None:
        return False
    identity = stored.get("identity")
    if not isinstance(identity, dict):
        raise ConfigError(f"config error: {store.root}/{cfg.run_name}/run.json holds no config identity")
    # recorded before a late setting existed, or with it at its default: the same run
    diff = _diff(drop_unset_late_settings(RunConfig, identity), _identity(cfg))
    if diff:
        raise ConfigError(
            f"config error: run {cfg.run_name!r} exists with another config ({diff[0]}"
            f"{f' and {len(diff) - 1} more' if len(diff) > 1 else ''}); use a new run_name or replay a stage"
        )
    check_recorded_plugins(stored.get("plugins") or {}, f"run {cfg.run_name!r}")
    check_recorded_callables(stored.get("callables") or {}, f"run {cfg.run_name!r}")
    return True


def record_run_config(store: ArtifactStore, cfg: RunConfig) -> None:
    """Store the resolved config with the run (once its inputs proved usable); refuse a conflicting one."""
    if not check_run_config(store, cfg):
        doc = {"config": cfg.model_dump(mode="json"), "identity": _identity(cfg)}
        # the plugins whose entries the config names and the code it names by import path, by distribution and
        # version (or module and source hash); a run that uses none records neither
        code = {"plugins": plugins_used(cfg), "callables": callables_used(cfg)}
        store.put_json(cfg.run_name, "run.json", {**doc, **{k: v for k, v in code.items() if v}})


# What a continuing command may be given: the settings naming the run's code, so that the code is this command's own
# (trusted) rather than the store's. Anything else is the run's own, stored config.
CODE_SETTINGS = ("plugins", "reward.function", "agent.function", "agent.tools", "data.source_settings.taskset", "data.source_settings.python")


def trusted_code(store: ArtifactStore, run_name: str, overrides: list[str] | tuple[str, ...]) -> set[str]:
    """The import paths ``overrides`` name again for a run continued with its stored config (``nightly``): each must
    be a setting naming code, with the value the run stored; one line otherwise."""
    stored = store.get_json(run_name, "run.json") or {}
    base = stored.get("config") if isinstance(stored.get("config"), dict) else {}
    for item in overrides:
        key = item.split("=", 1)[0].strip()
        if not any(key == c or key.startswith(c + ".") for c in CODE_SETTINGS):
            raise ConfigError(
                f"config error: {key}: a continued run keeps its stored settings; this command takes only the settings "
                f"naming its code ({', '.join(CODE_SETTINGS)}), to trust it (replay and eval take changed settings)"
            )
        given, kept = _dotted(parse_overrides([item]), key), _dotted(base, key)
        if given != kept:
            raise ConfigError(
                f"config error: {key}: run {run_name!r} was trained with {kept!r}, not {given!r}; name its code as stored "
                "(or start a new run_name)"
            )
    return {path for _, path in code_settings(parse_overrides(list(overrides)))}


def _dotted(tree: Any, key: str) -> Any:
    for part in key.split("."):
        tree = tree.get(part) if isinstance(tree, dict) else None
    return tree


def stored_config(
    store: ArtifactStore, run_name: str, overrides: list[str] | tuple[str, ...] = (), trusted: set[str] = frozenset()
) -> RunConfig:
    """The run's recorded config plus ``overrides``; code it names must be named by this invocation or allow-listed."""
    stored = store.get_json(run_name, "run.json")
    if stored is None:
        runs = store.runs()
        known = f"; runs there: {', '.join(runs)}" if runs else "; no runs there"
        raise ConfigError(f"run {run_name!r} does not exist under {store.root}{known}")
    where = f"{store.root}/{run_name}/run.json"
    load_plugins()  # the environment's: a stored config's own plugins are imported only once trusted (below)
    cfg = stored_config_from(stored, where, overrides, trusted)
    from rlstage.engines.preflight import check_registered_names

    check_registered_names(cfg)  # the names against the registries (this command's overrides too), as a config file's
    check_recorded_plugins(stored.get("plugins") or {}, f"run {run_name!r}")
    check_recorded_callables(stored.get("callables") or {}, f"run {run_name!r}")  # trusted by now: they may be located
    return cfg


def stored_config_with(store_root: str, run_name: str, overrides: list[str], what: str) -> tuple[ArtifactStore, RunConfig]:
    """The run's store and its stored config plus ``overrides`` (which may not move the run)."""
    for item in overrides:
        if item.split("=", 1)[0].split(".")[0] in FIXED:
            raise ConfigError(f"config error: {item.split('=', 1)[0]}: {what} cannot change it")
    store = ArtifactStore(store_root)
    cfg = stored_config(store, run_name, overrides)
    return store, cfg.model_copy(update={"store": cfg.store.model_copy(update={"root": absolute_root(store_root)})})


# ---------------------------------------------------------------- committed artifacts


def need(store: ArtifactStore, run: str, iteration: int | None, stage: str) -> Manifest:
    m = store.manifest(run, iteration, stage)
    if m is None:
        where = "run level" if iteration is None else f"iteration {iteration}"
        raise ConfigError(f"run {run!r} has no committed {stage} at {where}")
    return m


def last_completed_iteration(store: ArtifactStore, run: str) -> int:
    """The highest iteration whose update is committed (0 when none is)."""
    done = [it for it in store.iterations(run) if it > 0 and store.manifest(run, it, "update") is not None]
    return max(done, default=0)


def check_replay(store: ArtifactStore, run: str, iteration: int, stage: str) -> None:
    if stage not in REPLAYABLE:
        raise ConfigError(f"config error: stage {stage!r} cannot be replayed; valid: {', '.join(REPLAYABLE)}")
    need(store, run, iteration, stage)


def check_eval(store: ArtifactStore, run: str, iteration: int | None) -> int:
    """The iteration an evaluation scores (default: the last completed), refused when it has no policy."""
    last = last_completed_iteration(store, run)
    iteration = last if iteration is None else iteration
    if not 0 <= iteration <= last:
        raise ConfigError(f"config error: iteration: run {run!r} has policies for 0..{last}, got {iteration}")
    need(store, run, None, "data_prep")
    return iteration


def continuation_end(cfg: RunConfig, done: int, iterations: int) -> int:
    """The last iteration a continuation by ``iterations`` after ``done`` runs to. A run whose stages read its
    length (a decaying lr derives its steps from ``trainer.iterations``) continues only up to that planned
    length: past it, every earlier step's lr would have been another."""
    if not stage_reads(cfg, "trainer.iterations"):
        return done + iterations
    if done >= cfg.trainer.iterations:
        raise ConfigError(
            f"config error: run {cfg.run_name!r} has run all its trainer.iterations={cfg.trainer.iterations}, over which "
            "its lr decays; a run to continue past its length keeps a constant lr (actor.optim.lr_schedule=constant) "
            "or a fixed actor.optim.total_steps"
        )
    return min(done + iterations, cfg.trainer.iterations)


def check_checkpoints(store: ArtifactStore, run: str, iteration: int | None) -> None:
    """Refuse, before anything starts, a committed checkpoint there whose loading could run code (the
    workers refuse it too when they load: this makes it one line before any flow run)."""
    for stage in STAGES:
        m = store.manifest(run, iteration, stage)
        if m is not None and (reason := unsafe_checkpoint_file(m, store.artifact_dir(run, iteration, stage))):
            raise ConfigError(f"config error: {reason}")


def check_policy(store: ArtifactStore, cfg: RunConfig, iteration: int) -> None:
    """The checkpoints a command would load: the policy after ``iteration``, and the run's start (its reference
    policy too), the kit's SFT shared by every run with the same SFT settings, unless ``model.path`` names a folder
    (checked as an input)."""
    if iteration:
        check_checkpoints(store, cfg.run_name, iteration)
    if cfg.model.path is None:
        check_checkpoints(store, kit_run_name(cfg), None)


# ---------------------------------------------------------------- inputs


def check_model_dir(value: str) -> None:
    """A Hugging Face model folder: a readable ``config.json`` and complete safetensors weights."""
    path = Path(value).expanduser()
    if not path.is_dir():
        raise InputError(f"model.path {value}: not a directory")
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InputError(f"model.path {value}: no config.json (not a Hugging Face model directory)") from None
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise InputError(f"model.path {value}: config.json is unreadable: {err}") from None
    if not isinstance(config, dict):
        raise InputError(f"model.path {value}: config.json is not a JSON object")
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            files = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as err:
            raise InputError(f"model.path {value}: {index.name} is unreadable: {err}") from None
    else:
        files = [p.name for p in sorted(path.glob("*.safetensors"))]
    if not files:
        # Pickled weights (pytorch_model.bin) are never loaded: they can carry code.
        raise InputError(f"model.path {value}: no *.safetensors weights")
    for name in files:
        _check_safetensors(path / name, f"model.path {value}: {name}")


def _check_safetensors(file: Path, label: str) -> None:
    """The header parses and the file holds every byte it announces (a truncated copy fails here)."""
    try:
        size = file.stat().st_size
        with open(file, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > min(size - 8, 100 << 20):
                raise ValueError(f"header length {n} exceeds the file")
            header = json.loads(f.read(n))
        ends = [t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"]
    except FileNotFoundError:
        raise InputError(f"{label}: file is missing") from None
    except (OSError, struct.error, ValueError, KeyError, TypeError, AttributeError, IndexError) as err:
        raise InputError(f"{label}: not a readable safetensors file ({err})") from None
    if 8 + n + max(ends, default=0) > size:
        raise InputError(f"{label}: truncated ({size} bytes, its header announces {8 + n + max(ends)})")


def check_inputs(cfg: RunConfig) -> None:
    """Fail before anything is written when a named input does not exist or cannot be read."""
    from rlstage.engines.data.datasets import DatasetError, check_held_out, generates_prompts, load_prompts
    from rlstage.engines.preflight import check_data_source, check_rows_have_rewards

    if cfg.model.path is not None and not cfg.model.path.lower().endswith(".gguf"):  # a .gguf is converted at run start
        check_model_dir(cfg.model.path)
    check_data_source(cfg)  # the files are read with the source's settings
    given = [k for k in ("train_path", "test_path") if getattr(cfg.data, k)]
    if generates_prompts(cfg.data.source) and given:  # the files would be ignored: the kit's prompts trained instead
        raise InputError(
            f"data.{given[0]}: data.source={cfg.data.source} generates its prompts and reads no file; name the file's "
            "format with data.source (jsonl, parquet, verl_parquet or gsm8k)"
        )
    tables = {}
    for key in ("train_path", "test_path"):
        value = getattr(cfg.data, key)
        if value is None or "://" in value:
            continue
        if not Path(value).expanduser().is_file():
            raise InputError(f"data.{key} {value} does not exist")
        try:
            tables[key] = load_prompts(cfg.data.source, value, **cfg.data.source_settings)  # data prep reads it again; errors surface here first
        except DatasetError as err:
            raise InputError(f"data.{key}: {err}") from None
    if cfg.data.source == "verl_parquet":  # its rows name their data_source: each needs a reward
        check_rows_have_rewards(cfg, {s for t in tables.values() for s in t.column("data_source").to_pylist() if s})
    if len(tables) == 2:
        try:
            check_held_out(tables["train_path"], tables["test_path"], cfg.data.train_path, cfg.data.test_path)
        except DatasetError as err:
            raise InputError(f"data.test_path: {err}") from None


def check_prefect_api(url: str, timeout_s: float = 3.0) -> None:
    """The Prefect API at ``PREFECT_API_URL`` answers its health check."""
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/health", timeout=timeout_s):
            pass
    except (OSError, ValueError) as err:
        raise InputError(f"Prefect API {url} (PREFECT_API_URL) is unreachable: {err}") from None
