"""The ``rlstage`` command: demo, train, nightly, replay, eval, export, data-prep, compare, inspect, ui."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import NoReturn

from rlstage.infra.env import apply_defaults
from rlstage.schemas.stages import REPLAYABLE

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "demo.yaml"


class PrefectLost(RuntimeError):
    """The command's Prefect server stopped answering while it ran."""


class RayLost(RuntimeError):
    """The Ray cluster a run used stopped answering while it ran."""


RAY_RESTARTS = 3  # times a command starts again the local Ray it started, within one invocation


def _ray_answers(timeout_s: float = 10.0) -> bool:
    """Whether this process's Ray (if it joined one) still runs a task."""
    import ray

    if not ray.is_initialized():
        return True  # no Ray to lose: the failure is another one
    try:
        ray.get(ray.remote(num_cpus=0)(lambda: None).remote(), timeout=timeout_s)
        return True
    except Exception:  # whatever a dead raylet or GCS raises, or the timeout
        return False


def healing_ray(run: Callable[[], dict], address: str | None) -> dict:
    """``run()`` (a training or nightly flow); when the local Ray this command started dies under it, Ray is
    started again and ``run()`` goes on from the committed stages, at most RAY_RESTARTS times, each said in one
    line. A cluster at ``address`` the command did not start is not its to restart: RayLost, one line."""
    import ray

    from rlstage.flows import terminal
    from rlstage.infra.ray_runtime import RAY_LOST, mute_node_death_reports

    if not terminal.verbose():
        mute_node_death_reports()
    restarts = 0
    while True:
        try:
            return run()
        except Exception as err:
            if _stopped(err) is not None or (not RAY_LOST.is_set() and _ray_answers()):
                raise
            ray.shutdown()
            if address:
                raise RayLost(f"the Ray cluster at {address} stopped answering during the run") from err
            if restarts == RAY_RESTARTS:
                raise RayLost(f"the local Ray this command started died {restarts + 1} times during the run") from err
            restarts += 1
            print(
                f"rlstage: the local Ray this command started died; started again (restart {restarts} of {RAY_RESTARTS}), "
                "the run goes on from its committed stages",
                file=sys.stderr,
                flush=True,
            )


@contextmanager
def _lost_if_down(url: str):
    """A failure while the Prefect server at ``url`` no longer answers is said as that."""
    from rlstage.flows.checks import InputError, check_prefect_api

    try:
        yield url
    except Exception as err:
        try:
            check_prefect_api(url)
        except InputError:
            raise PrefectLost(f"the Prefect server {url} stopped answering during the run") from err
        raise


@contextmanager
def _prefect_settings(url: str, prefect_home: Path):
    """Prefect's settings in this process name ``url`` and the home: they were read from the environment when Prefect
    was imported, so without this its clients (the flow's, its log and event workers') found no API URL and each
    command started a second, ephemeral server of Prefect's own beside the one it chose."""
    from prefect.settings import PREFECT_API_URL, PREFECT_HOME, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: url, PREFECT_HOME: str(prefect_home)}):
        yield


@contextmanager
def prefect_api(cfg=None):
    """The Prefect API of this command: ``PREFECT_API_URL`` if set, else the server that runs on the local
    home (``infra/home.py``: ``rlstage ui``, ``infra/stack.sh``), else a server on that home started for the
    duration. The home's MLflow server, when one runs, is the default tracking URI meanwhile. Given the run's
    config, a local Ray for it starts while that server boots (its workers inherit the server's URL)."""
    from rlstage.flows import terminal
    from rlstage.infra import home

    if not terminal.verbose():
        _quiet_prefect_run_errors()
    mlflow_url = home.running_service(home.MLFLOW_SERVICE)
    if mlflow_url and not os.environ.get("MLFLOW_TRACKING_URI"):
        os.environ["MLFLOW_TRACKING_URI"] = mlflow_url
    from rlstage.infra.prefect_server import quick_retries_on_a_local_server

    if os.environ.get("PREFECT_API_URL"):
        quick_retries_on_a_local_server()
        with _lost_if_down(os.environ["PREFECT_API_URL"]) as url:
            yield url
        return
    os.environ["PREFECT_HOME"] = str(home.prefect_home())
    if left := home.stop_leftovers(home.prefect_home()):
        print(f"rlstage: stopped {len(left)} process(es) left running on this home by a command that was killed", file=sys.stderr, flush=True)
    url = home.running_service(home.PREFECT_SERVICE)
    if url:
        os.environ["PREFECT_API_URL"] = url
        quick_retries_on_a_local_server()
        with _prefect_settings(url, home.prefect_home()), _lost_if_down(url):
            yield url
        return
    from rlstage.infra.prefect_server import ServerKeeper, retry_refused_connections, start_prefect_server

    print(f"starting a local Prefect server on 127.0.0.1 (home {home.prefect_home()}) ...", file=sys.stderr, flush=True)
    server = start_prefect_server(home.prefect_home(), meanwhile=_while_the_server_boots(cfg))
    if os.environ.get("PREFECT_API_URL") != server.url:  # its port was taken meanwhile: Ray's workers name the old one
        _stop_ray()
    os.environ["PREFECT_API_URL"] = server.url
    # what this command started, it heals: a server that dies mid-run is started again on the same home and port
    keeper = ServerKeeper(server, lambda line: print(f"rlstage: {line}", file=sys.stderr, flush=True))
    keeper.start()
    retry_refused_connections()
    quick_retries_on_a_local_server()
    try:
        with _prefect_settings(server.url, home.prefect_home()), _lost_if_down(server.url):
            yield server.url
    finally:
        from prefect.logging.handlers import APILogHandler

        keeper.stop()
        APILogHandler().flush()  # the run's logs reach the server before it stops
        server.stop()


def _while_the_server_boots(cfg) -> Callable[[str], None] | None:
    """What runs while the command's Prefect server boots: a run's local Ray starts (its workers inherit the
    server's URL), then the drill point ``prefect_server:start`` (``drill.hold_worker_at``), where a test kills
    the server before the command has seen it answer. None without a config."""
    if cfg is None:
        return None

    def start(url: str) -> None:
        from rlstage.infra.drill import hold_point
        from rlstage.infra.ray_runtime import cluster_address

        if not cluster_address(cfg):
            from rlstage.flows import terminal
            from rlstage.infra.ray_runtime import ensure_ray, mute_node_death_reports

            if not terminal.verbose():
                mute_node_death_reports()  # a raylet killed in its start: the restart's one line says it
            os.environ["PREFECT_API_URL"] = url  # before Ray starts: its workers report to this server
            ensure_ray(cfg)
        hold_point(cfg, "prefect_server:start")

    return start


def _stop_ray() -> None:
    import ray

    ray.shutdown()


def _load(args) -> object:
    from rlstage.engines.preflight import check_registered_names
    from rlstage.schemas.config import load_config

    if getattr(args, "verl", False):
        cfg = _load_verl(args)
    else:
        cfg = load_config(args.config, args.overrides)
    check_registered_names(cfg)  # names looked up in the engines' registries: part of loading the config
    return cfg


def _load_verl(args) -> object:
    """A verl recipe, translated (flows/verl_recipe.py): what it dropped in a line each, then its rlstage settings."""
    import yaml

    from rlstage.flows.verl_recipe import config_tree, translate
    from rlstage.schemas.config import build_config

    recipe = translate(args.config, args.overrides)
    tree = config_tree(recipe)
    cfg = build_config(tree)
    noted = [line for line in recipe.mapped if line.endswith(")") or args.verbose]
    print(f"rlstage: verl recipe: {len(recipe.mapped)} settings mapped, {len(recipe.dropped)} keys dropped, "
          f"{len(recipe.passthrough)} rlstage settings as given", flush=True)  # fmt: skip
    for line in noted:
        print(f"rlstage: verl mapped {line}", flush=True)
    for line in recipe.dropped:
        print(f"rlstage: verl dropped {line}", flush=True)
    resolved = yaml.safe_dump(tree, sort_keys=False, default_flow_style=None).rstrip()
    print("rlstage: the recipe as rlstage settings (the rest are rlstage's defaults):\n" + resolved, flush=True)
    return cfg


@contextmanager
def _deprecations_said():
    """A setting read under its old name (``ConfigDeprecation``) is said in one line, ``rlstage: <message>``, once per
    command, whichever step of it loads a config: a config file (train, demo, data-prep, reward-model) or a stored run's
    config (nightly, replay, eval, and the flows they run in this process). Other warnings are shown as before."""
    from rlstage.schemas.config import ConfigDeprecation

    said: set[str] = set()
    show = warnings.showwarning

    def say(message, category, filename, lineno, file=None, line=None):
        if not issubclass(category, ConfigDeprecation):
            return show(message, category, filename, lineno, file, line)
        if str(message) not in said:
            said.add(str(message))
            print(f"rlstage: {message}", file=sys.stderr, flush=True)

    with warnings.catch_warnings():  # restores the filters and showwarning when the command returns
        warnings.simplefilter("always", ConfigDeprecation)  # shown wherever raised (a DeprecationWarning is hidden by default)
        warnings.showwarning = say
        yield


def _check_services() -> None:
    """A Prefect API named by ``PREFECT_API_URL`` must answer before anything starts."""
    from rlstage.flows.checks import check_prefect_api

    if os.environ.get("PREFECT_API_URL"):
        check_prefect_api(os.environ["PREFECT_API_URL"])


def _check_new_run(cfg, tracking: bool = True):
    """Inputs, store and services of a train / data-prep command, checked before any flow run; returns the store."""
    from rlstage.engines.preflight import preflight
    from rlstage.flows.checks import check_inputs, check_run_config
    from rlstage.infra.store import ArtifactStore

    check_inputs(cfg)
    preflight(cfg)  # the model, engines, tools and reward function this config names
    store = ArtifactStore(cfg.store.root, cfg.store.storage_options, cfg.store.retries)
    store.check_writable()
    check_run_config(store, cfg)
    if tracking:
        from rlstage.infra.tracking import check_reachable, tracking_uri_for

        check_reachable(tracking_uri_for(cfg))
    _check_services()
    return store


def cmd_train(args) -> int:
    from rlstage.flows.checks import check_policy, last_completed_iteration
    from rlstage.infra.lease import check_lease

    cfg = _load(args)
    if getattr(args, "dry_run", False):
        from rlstage.schemas.config import config_to_yaml

        print(config_to_yaml(cfg), end="", flush=True)
        return 0
    store = _check_new_run(cfg)
    check_policy(store, cfg, last_completed_iteration(store, cfg.run_name))  # what the run would start from
    check_lease(store, cfg.run_name)  # a run already running: refused before a server starts or a flow run exists
    with prefect_api(cfg):
        from rlstage.flows.training import train
        from rlstage.infra.ray_runtime import cluster_address

        result = healing_ray(lambda: train(config=cfg), cluster_address(cfg))
    _summary(result)
    return 0


def cmd_demo(args) -> int:
    args.config = args.config or DEFAULT_CONFIG
    t0 = time.perf_counter()
    code = cmd_train(args)
    print(f"demo wall time: {time.perf_counter() - t0:.0f}s", flush=True)
    return code


def cmd_nightly(args) -> int:
    from rlstage.flows.checks import (
        check_inputs,
        check_policy,
        continuation_end,
        last_completed_iteration,
        stored_config,
        trusted_code,
    )
    from rlstage.infra.lease import check_lease
    from rlstage.infra.store import ArtifactStore
    from rlstage.schemas.config import ConfigError

    if args.iterations < 1:
        raise ConfigError(f"config error: --iterations: must be >= 1, got {args.iterations}")
    store = ArtifactStore(args.store)
    trusted = trusted_code(store, args.run, args.overrides)  # the run's code, named again by this command
    cfg = stored_config(store, args.run, trusted=trusted)
    check_inputs(cfg)
    check_lease(store, args.run)
    done = last_completed_iteration(store, args.run)
    continuation_end(cfg, done, args.iterations)
    check_policy(store, cfg, done)
    _check_services()
    with prefect_api(cfg):
        from rlstage.flows.nightly import nightly
        from rlstage.infra.ray_runtime import cluster_address

        result = healing_ray(
            lambda: nightly(run_name=args.run, iterations=args.iterations, store_root=args.store, trusted=sorted(trusted)),
            cluster_address(cfg),
        )
    _summary(result)
    return 0


def cmd_replay(args) -> int:
    from rlstage.flows.checks import check_replay, stored_config_with

    store, cfg = stored_config_with(args.store, args.run, args.overrides, "a replay")
    check_replay(store, args.run, args.iteration, args.stage)
    _check_services()
    with prefect_api(cfg):
        from rlstage.flows.replay import format_summary, replay

        summary = replay(
            run_name=args.run, iteration=args.iteration, stage=args.stage, store_root=args.store, overrides=args.overrides
        )
    print(format_summary(summary))
    return 0


def cmd_eval(args) -> int:
    from rlstage.flows.checks import check_eval, check_policy, stored_config_with

    store, cfg = stored_config_with(args.store, args.run, args.overrides, "an evaluation")
    check_policy(store, cfg, check_eval(store, args.run, args.iteration))
    _check_services()
    with prefect_api(cfg):
        from rlstage.flows.evaluate import evaluate_run
        from rlstage.infra.story import published

        result = evaluate_run(
            run_name=args.run, iteration=args.iteration, store_root=args.store, overrides=args.overrides
        )
    state = "evaluated" if result["executed"] else "already evaluated (committed)"
    print(f"{state}: policy of iteration {result['iteration']} of run {result['run']} -> {result['artifact']}")
    for k, v in sorted(result["metrics"].items()):
        print(f"  {k}: {v:.4g}")
    print(published(result))
    return 0


def cmd_export(args) -> int:
    from rlstage.flows.export import export_policy

    result = export_policy(args.store, args.run, args.iteration, args.out)
    kind = "its LoRA adapter merged into its base" if result["merged"] else "full weights"
    print(f"policy of iteration {result['iteration']} of run {result['run']} ({kind}) -> {result['out']}")
    return 0


def cmd_data_prep(args) -> int:
    cfg = _load(args)
    _check_new_run(cfg, tracking=False)
    with prefect_api():
        from rlstage.flows.data_prep import prepare_data

        result = prepare_data(config=cfg)
    print(f"prompts of run {result['run']}: {result['train_rows']} train, {result['test_rows']} test")
    print(f"  {result['train']}\n  {result['test']}")
    return 0


def cmd_init(args) -> int:
    from rlstage.flows.init import InitChoices, absolute, write_config

    run_name = args.run_name or args.out.stem
    reward = args.reward
    if reward and ".py:" in reward:  # a reward file, read from wherever the run trains
        reward = f"{absolute(reward.rsplit(':', 1)[0])}:{reward.rsplit(':', 1)[1]}"
    choices = InitChoices(
        absolute(args.model), absolute(args.train), absolute(args.test), reward, args.prompt_column, args.answer_column,
        run_name, args.data_source, tuple(args.overrides),
    )  # fmt: skip
    written = write_config(choices, args.out)
    print(f"wrote {written.path}: run {written.run_name} on {args.model}, data.source={written.source}")
    if written.estimate:
        print(f"  {written.estimate}")
    print(f"  next: rlstage train -c {written.path}")
    return 0


def cmd_reward_model(args) -> int:
    import json

    from rlstage.flows.checks import check_inputs
    from rlstage.flows.reward_kit import RMKitSettings, build_kit_reward_model, check_kit_reward_model
    from rlstage.infra.store import ArtifactStore
    from rlstage.schemas.config import load_config

    # The config of the run the RM is for: its kit and SFT; its reward_model section names what is built here.
    cfg = load_config(args.config, [*args.overrides, "reward_model.enable=false"])
    settings = RMKitSettings(args.prompts, args.samples_per_prompt, args.steps, args.batch_size, args.lr, args.seed)
    check_kit_reward_model(cfg, settings, args.out)
    check_inputs(cfg)
    ArtifactStore(cfg.store.root, cfg.store.storage_options, cfg.store.retries).check_writable()
    _check_services()
    with prefect_api():
        result = build_kit_reward_model(out=str(args.out), settings=settings, config=cfg)
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in result.items()}))
    print(f"reward model -> {result['out']} (use: reward_model.enable=true reward_model.model.path={result['out']})")
    return 0


def cmd_compare(args) -> int:
    from rlstage.flows.compare import main as compare_main

    return compare_main(args.rest)


def cmd_inspect(args) -> int:
    import polars as pl

    from rlstage.infra.explore import Experience, run_query
    from rlstage.infra.store import ArtifactStore

    iterations = None if args.iteration is None else [args.iteration]
    exp = Experience.open(ArtifactStore(args.store), args.run, iterations, sample_id=args.sample)
    frame = run_query(exp, args.query, args.limit).collect()
    wide = 100 if args.query == "trajectory" else 40  # a turn's content is what it shows
    with pl.Config(tbl_rows=-1, tbl_cols=-1, fmt_str_lengths=wide, tbl_width_chars=200, tbl_hide_dataframe_shape=True):
        print(frame)
    return 0


def cmd_ui(args) -> int:
    from rlstage.infra.ui import serve

    return serve(args.prefect_port, args.mlflow_port)


def _summary(result: dict) -> None:
    hist = [h for h in result["history"] if "val/accuracy" in h]
    # a partial-credit reward (a format score) makes the mean reward another number than the share correct
    partial = any(abs(h.get("val/reward_mean", h["val/accuracy"]) - h["val/accuracy"]) > 1e-9 for h in hist)
    print("\nheld-out accuracy (greedy answers scored correct)" + (", and their mean reward:" if partial else ":"))
    for h in hist:
        reward = f"   mean reward {h['val/reward_mean']:.3f}" if partial else ""
        print(f"  iteration {h['iteration']:>3}: {h['val/accuracy']:.3f}{reward}")
    if len(hist) >= 2:
        gain = hist[-1]["val/accuracy"] - hist[0]["val/accuracy"]
        print(f"learning: {hist[0]['val/accuracy']:.3f} -> {hist[-1]['val/accuracy']:.3f} ({gain * 100:+.1f} points)")
    from rlstage.flows.records import flat_rewards

    trained = [h for h in result["history"] if "critic/score/max" in h]
    if trained and all(flat_rewards(h) for h in trained):
        same = trained[-1]["critic/score/max"] == trained[-1]["critic/score/min"]
        scored = f"every sample of every iteration scored {trained[-1]['critic/score/max']:g}" if same else (
            "in every iteration each group's samples all scored the same"
        )  # fmt: skip
        print(
            f"warning: {scored}: no group had a signal to learn from "
            "(check the reward function against a few answers: rlstage inspect RUN -q worst)"
        )
    print(f"artifacts: {result['store']}/{result['run']}")
    print(f"mlflow: {result['mlflow']}")


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage mistake is one line (exit 2) instead of the usage text plus the error."""

    def error(self, message: str):
        print(f"{self.prog}: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(2)


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Shows an argument's default where it has one."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default in (None, False):
            return action.help
        return super()._get_help_string(action)


class _SubParser(_Parser):
    _mixing = False

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, formatter_class=_Help, **kwargs)

    def parse_known_args(self, args=None, namespace=None):
        """Overrides anywhere on the line (``eval exp1 -i 7 trainer.eval_n=16``): options and positionals
        intermixed, except where a REMAINDER takes the rest as it stands (compare)."""
        if self._mixing or any(a.nargs == argparse.REMAINDER for a in self._actions):
            return super().parse_known_args(args, namespace)
        self._mixing = True  # parse_known_intermixed_args calls parse_known_args itself
        try:
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self._mixing = False


def _version() -> str:
    """The installed version, and the commit when this is a git checkout (an editable install, a clone)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        text = version("rlstage")
    except PackageNotFoundError:  # run from a source tree that was not installed
        text = "(not installed)"
    root = Path(__file__).resolve().parent.parent
    if (root / ".git").exists():
        got = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        if got.returncode == 0:
            text += f" (commit {got.stdout.strip()})"
    return text


class _Version(argparse.Action):
    """``--version``, found only when asked (a checkout's commit costs a git call)."""

    def __init__(self, option_strings, dest, **kw) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kw)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        print(f"rlstage {_version()}")
        parser.exit()


# Where each subcommand is explained (docs/ of the repository; `mkdocs serve` shows them as a site).
DOCS = {
    "demo": "usage.md", "train": "usage.md", "nightly": "usage.md", "replay": "usage.md", "eval": "usage.md",
    "export": "usage.md", "data-prep": "usage.md", "reward-model": "algorithms.md", "compare": "inspecting.md",
    "inspect": "inspecting.md", "ui": "usage.md", "init": "data.md",
}  # fmt: skip


class Stopped(KeyboardInterrupt):
    """SIGTERM (or SIGINT), raised in the main thread so every ``finally`` stops what this command started."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _stopped(err: BaseException) -> Stopped | None:
    """The signal behind ``err``: a Stopped raised while C code ran surfaces as the cause of a SystemError
    ("returned a result with an exception set"), or wrapped by a library."""
    seen: set[int] = set()
    cur: BaseException | None = err
    while cur is not None and id(cur) not in seen:
        if isinstance(cur, Stopped):
            return cur
        seen.add(id(cur))
        cur = cur.__cause__ or cur.__context__
    return None


def _stop_on_signals() -> None:
    """The first SIGINT/SIGTERM unwinds the command (servers, Ray, engines stop); a second one forces."""

    def first(signum: int, frame) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        raise Stopped(signum)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, first)


class _RunStateErrors(logging.Filter):
    """Prefect's ERROR lines of failed or crashed flow and task runs: the command's last line says what failed,
    and the runs' logs in the Prefect UI keep them (``--verbose`` prints them too)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno < logging.ERROR or not record.name.startswith(("prefect.flow_runs", "prefect.task_runs"))


def _quiet_prefect_run_errors() -> None:
    from prefect.logging.configuration import ensure_logging_setup

    ensure_logging_setup()  # Prefect's console handler, on the root logger (set up when prefect.main is imported)
    for handler in logging.getLogger().handlers:
        if "Console" in type(handler).__name__ and not any(isinstance(f, _RunStateErrors) for f in handler.filters):
            handler.addFilter(_RunStateErrors())


def _hide_prefect_tracebacks() -> None:
    """Prefect logs a failed task or flow run with its traceback; the command ends with one line instead."""
    make = logging.getLogRecordFactory()

    def factory(name, level, fn, lno, msg, args, exc_info, func=None, sinfo=None, **kwargs):
        if name.startswith("prefect"):
            exc_info = None
        return make(name, level, fn, lno, msg, args, exc_info, func, sinfo, **kwargs)

    logging.setLogRecordFactory(factory)


def raised_in_worker(err: BaseException) -> BaseException:
    """The exception a Ray worker raised (a role's actor, a stage's task), behind Ray's wrapper, whose text is the
    worker's traceback with Ray's process repr and colour codes: its own one line is what the user reads, with the
    same exit code as when it is raised in the command's process."""
    exceptions = sys.modules.get("ray.exceptions")  # never imported for a mistake found before Ray starts
    while exceptions is not None and isinstance(err, exceptions.RayTaskError) and err.cause is not None:
        err = err.cause
    return err


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split()) or type(err).__name__


def _user_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that mean the user's input is wrong (exit 2): each carries one line naming it."""
    from rlstage.engines.data.datasets import DatasetError
    from rlstage.engines.rewards.rules import RewardFailure
    from rlstage.flows.checks import InputError
    from rlstage.infra.lease import RunLocked
    from rlstage.infra.ray_runtime import RayUnreachable
    from rlstage.infra.store import StoreError
    from rlstage.infra.tracking import TrackingUnavailable
    from rlstage.schemas.config import ConfigError

    return (
        ConfigError, InputError, DatasetError, RewardFailure, FileNotFoundError, StoreError, RunLocked, TrackingUnavailable,
        RayUnreachable,
    )  # fmt: skip


def build_parser() -> _Parser:
    """The command line: every subcommand, its arguments, choices and defaults."""
    from rlstage.schemas.docs_site import page_url

    parser = _Parser(
        prog="rlstage",
        description="RL post-training as Prefect stages on Ray",
        epilog=f"Documentation: {page_url('index.md')} (in a checkout also docs/; `mkdocs serve` shows it); "
        f"every config setting: {page_url('reference/config.md')}",
    )
    parser.add_argument(
        "-v", "--verbose", action="store_true", help="print each stage as it ends, and tracebacks (also RLSTAGE_DEBUG=1)"
    )
    parser.add_argument("--version", action=_Version, help="print the version (and the commit of a checkout)")
    # Every subcommand's help shows its defaults.
    sub = parser.add_subparsers(dest="cmd", required=True, parser_class=_SubParser)
    for name, fn, helptext in (
        ("demo", cmd_demo, "tiny kit + GRPO on CPU through Prefect, Ray, the store and MLflow"),
        ("train", cmd_train, "a training run from a config (continues where it stopped)"),
    ):
        p = sub.add_parser(name, help=helptext)
        p.add_argument("-c", "--config", type=Path, default=None, help="YAML config (default: the demo's)")
        p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. actor.optim.lr=1e-5")
        if name == "train":
            p.add_argument("--verl", action="store_true", help="the config and overrides are a verl recipe's keys "
                           "(e.g. actor_rollout_ref.actor.ppo_mini_batch_size=64), translated to rlstage's")  # fmt: skip
            p.add_argument("--dry-run", action="store_true", help="check the config and print it in full; start nothing")
        p.set_defaults(fn=fn)
    p = sub.add_parser("nightly", help="continue a run by K iterations with its stored config")
    p.add_argument("run", help="run name")
    p.add_argument("-k", "--iterations", type=int, default=1, help="iterations to add")
    p.add_argument(
        "overrides", nargs="*", help="the run's code named again, as stored, to trust it: plugins, reward.function, agent.function, agent.tools"
    )
    p.add_argument("--store", default="./rlstage-runs", help="store root of the run")
    p.set_defaults(fn=cmd_nightly)
    p = sub.add_parser("replay", help="re-execute one stage of one iteration from its stored inputs")
    p.add_argument("run", help="run name")
    p.add_argument("iteration", type=int, help="iteration whose stage is replayed")
    p.add_argument("stage", help=f"one of: {', '.join(REPLAYABLE)}")
    p.add_argument("overrides", nargs="*", help="changed settings, e.g. reward.function=gsm8k_flexible")
    p.add_argument("--store", default="./rlstage-runs", help="store root of the run")
    p.set_defaults(fn=cmd_replay)
    p = sub.add_parser("eval", help="evaluate a stored policy of a run (default: its last iteration)")
    p.add_argument("run", help="run name")
    p.add_argument("-i", "--iteration", type=int, default=None, help="policy after this update (0: the start; default: the last)")
    p.add_argument("overrides", nargs="*", help="changed eval settings, e.g. trainer.eval_n=16")
    p.add_argument("--store", default="./rlstage-runs", help="store root of the run")
    p.set_defaults(fn=cmd_eval)
    p = sub.add_parser("export", help="write a stored policy as a Hugging Face folder (LoRA: merged into its base)")
    p.add_argument("run", help="run name")
    p.add_argument("-i", "--iteration", type=int, default=None, help="policy after this update (0: the start; default: the last)")
    p.add_argument("-o", "--out", required=True, help="the folder to write (new or empty)")
    p.add_argument("--store", default="./rlstage-runs", help="store root of the run")
    p.set_defaults(fn=cmd_export)
    p = sub.add_parser("data-prep", help="commit a run's prompts artifact (train/test splits)")
    p.add_argument("-c", "--config", type=Path, default=None, help="YAML config (default: built-in defaults)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. data.source=gsm8k")
    p.set_defaults(fn=cmd_data_prep)
    p = sub.add_parser("init", help="write a commented starting config for your model folder and prompt files")
    p.add_argument("--model", required=True, help="a Hugging Face model folder (or .gguf file) to train")
    p.add_argument("--train", required=True, help="your training prompts: JSONL, or Parquet by its .parquet suffix")
    p.add_argument("--test", required=True, help="your held-out prompts (never trained on), same format")
    p.add_argument("--prompt-column", default="prompt", help="the column holding each prompt (a string or chat messages)")
    p.add_argument("--answer-column", default="answer", help="the column holding each reference answer")
    p.add_argument("--reward", default=None, help="how answers are scored: exact_match, gsm8k_flexible, ... or module:function")
    p.add_argument("-o", "--out", type=Path, default=Path("rlstage.yaml"), help="the config file to write (new)")
    p.add_argument("--run-name", default=None, help="the run's name (default: the file's stem)")
    p.add_argument("--data-source", default=None, choices=["jsonl", "parquet", "verl_parquet", "gsm8k"],
                   help="the files' format (default: parquet by the .parquet suffix, else jsonl)")  # fmt: skip
    p.add_argument("overrides", nargs="*", help="settings written over the starting points, e.g. rollout.max_new_tokens=32")
    p.set_defaults(fn=cmd_init)
    p = sub.add_parser("reward-model", help="train a tiny reward model for the kit's task on its SFT policy's samples")
    p.add_argument("-c", "--config", type=Path, default=None, help="YAML config of the run it is for (its kit and SFT)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. kit.digits=1")
    p.add_argument("-o", "--out", type=Path, required=True, help="the folder to write (new or empty)")
    p.add_argument("--prompts", type=int, default=4000, help="train prompts sampled")
    p.add_argument("--samples-per-prompt", type=int, default=8, help="SFT samples per prompt, labelled by the rule")
    p.add_argument("--steps", type=int, default=2000, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=64, help="samples per step")
    p.add_argument("--lr", type=float, default=3e-4, help="AdamW learning rate")
    p.add_argument("--seed", type=int, default=0, help="sampling and batching seed")
    p.set_defaults(fn=cmd_reward_model)
    p = sub.add_parser("compare", help="compare runs from MLflow: table + PNG of curves")
    p.add_argument("rest", nargs=argparse.REMAINDER, help="RUN [RUN ...] [--tracking-uri URI] [--png out.png]")
    p.set_defaults(fn=cmd_compare)

    from rlstage.infra.explore import QUERIES

    p = sub.add_parser("inspect", help="query a run's rollouts, rewards and experience (polars)")
    p.add_argument("run", help="run name")
    p.add_argument("-q", "--query", choices=list(QUERIES), default="rewards", help="the query")
    p.add_argument("-i", "--iteration", type=int, default=None, help="one iteration (None: all)")
    p.add_argument("-n", "--limit", type=int, default=10, help="rows of best/worst/logprob-gap, samples of trajectory")
    p.add_argument("-s", "--sample", default=None, help="one sample id (e.g. a trajectory's)")
    p.add_argument("--store", default="./rlstage-runs", help="store root of the run")
    p.set_defaults(fn=cmd_inspect)

    p = sub.add_parser("ui", help="the Prefect and MLflow UIs on the local home's runs, until Ctrl-C")
    p.add_argument("--prefect-port", type=int, default=4200, help="Prefect UI port (another free one if taken)")
    p.add_argument("--mlflow-port", type=int, default=5000, help="MLflow UI port (another free one if taken)")
    p.set_defaults(fn=cmd_ui)

    for name, p in sub.choices.items():
        p.epilog = f"More: {page_url(DOCS[name])}; every config setting: {page_url('reference/config.md')}"
    for p in sub.choices.values():  # "rlstage train --verbose" works as well as "rlstage --verbose train"
        p.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    """The ``rlstage`` command: its exit code. Run as the command (no ``argv``: the console script, ``python -m
    rlstage.flows.cli``), the process ends here once its exit handlers ran (``end_process``)."""
    code = _main(argv)
    if argv is None:
        end_process(code)
    return code


def end_process(code: int) -> NoReturn:
    """End this process with ``code`` as the interpreter's own exit does, without its teardown: ``threading``'s exit
    (its exit callbacks, where Prefect drains its log and event queues, then a join of the threads that are not
    daemons), the local Ray this process started stops (as its exit handler would, less the half second it waits
    for log lines: this command does not forward them), every exit handler runs (Ray's, logging's, MLflow's, the
    temporary folders' finalizers), the standard streams are flushed, then ``os._exit``. What is skipped, the
    garbage collection and clearing of every module that torch, Prefect, Ray and MLflow loaded, freed nothing the
    exit does not and took ~3 s of each command's end on 2 cores (a stop on SIGTERM included)."""
    import atexit
    import threading

    try:
        threading._shutdown()  # what the interpreter's exit runs first (Py_FinalizeEx)
        ray = sys.modules.get("ray")
        if ray is not None and ray.is_initialized():
            ray.shutdown()
    except KeyboardInterrupt:  # a signal meanwhile (Stopped): the exit handlers still run, as at the interpreter's exit
        pass
    atexit._run_exitfuncs()  # each handler's failure is said and the others run, as at the interpreter's exit
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try:
            stream.flush()
        except Exception:  # a stream already closed, or None
            pass
    os._exit(code)


def _main(argv: list[str] | None) -> int:
    apply_defaults()
    from rlstage.infra.home import OWNER_ENV

    os.environ[OWNER_ENV] = str(os.getpid())  # what this command starts carries it: stop_leftovers finds it if killed
    args = build_parser().parse_args(argv)
    verbose = args.verbose or os.environ.get("RLSTAGE_DEBUG", "") not in ("", "0")
    if verbose:  # stage detail as lines (flows/terminal.py), in this process and the flow runs it starts
        os.environ["RLSTAGE_VERBOSE"] = "1"
    else:  # Prefect's INFO lines ("Beginning subflow run ...") go to the run's logs in the UI, not the terminal
        os.environ.setdefault("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", "WARNING")
    user_errors = _user_errors()
    _stop_on_signals()
    if not verbose:
        _hide_prefect_tracebacks()
        logging.raiseExceptions = False  # a log handler's failure (Prefect's, once its server is gone) is not the command's
    try:
        with _deprecations_said():
            return args.fn(args)
    except Exception as raised:
        if verbose:
            traceback.print_exc()
        err = raised_in_worker(raised)
        if (stop := _stopped(err)) is not None:
            return _report_stop(stop.signum)
        if isinstance(err, user_errors):
            from rlstage.schemas.settings_help import reference_link

            line = _one_line(err)
            if link := reference_link(line):  # a "config error: <setting>: ..." line: where the setting is explained
                line += f" (see {link})"
            print(f"rlstage: {line}", file=sys.stderr)
            return 2
        from rlstage.infra.prefect_server import ServerFailedToStart
        from rlstage.infra.ray_runtime import RayFailedToStart

        if isinstance(err, ServerFailedToStart | RayFailedToStart):
            print(f"rlstage: {_one_line(err)}; nothing of the run started, rerun the command", file=sys.stderr)
            return 3
        if isinstance(err, PrefectLost | RayLost):  # the run stops; the next invocation reuses its committed stages
            print(f"rlstage: {err}; committed stages are kept, rerun the command to continue", file=sys.stderr)
            return 3
        hint = "" if verbose else " (--verbose or RLSTAGE_DEBUG=1 prints the traceback)"
        print(f"rlstage: internal error: {type(err).__name__}: {_one_line(err)}{hint}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as err:
        return _report_stop(err.signum if isinstance(err, Stopped) else signal.SIGINT)


def _report_stop(signum: int) -> int:
    print(f"rlstage: stopped by {signal.Signals(signum).name}; rerun the command to continue", file=sys.stderr)
    return 128 + signum


if __name__ == "__main__":
    sys.exit(main())
