"""The ``rlstage`` command: demo, train, nightly, replay, eval, data-prep, compare, inspect."""

from __future__ import annotations

import argparse
import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from infra.env import apply_defaults

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "demo.yaml"


@contextmanager
def prefect_api(state_dir: str):
    """Use ``PREFECT_API_URL`` if set, else start a local Prefect server for the duration."""
    if os.environ.get("PREFECT_API_URL"):
        yield os.environ["PREFECT_API_URL"]
        return
    from infra.prefect_server import start_prefect_server

    print("starting a local Prefect server on 127.0.0.1 ...", file=sys.stderr, flush=True)
    server = start_prefect_server(Path(state_dir) / "prefect")
    os.environ["PREFECT_API_URL"] = server.url
    os.environ["PREFECT_HOME"] = str(server.home)
    # This server stops when the command ends: shipping logs to it at exit would only fail.
    os.environ.setdefault("PREFECT_LOGGING_TO_API_ENABLED", "false")
    try:
        yield server.url
    finally:
        server.stop()


def _load(args) -> object:
    from schemas.config import load_config

    return load_config(args.config, args.overrides)


def cmd_train(args) -> int:
    cfg = _load(args)
    with prefect_api(cfg.store.root if "://" not in cfg.store.root else ".rlstage"):
        from flows.training import train

        result = train(config=cfg)
    _summary(result)
    return 0


def cmd_demo(args) -> int:
    args.config = args.config or DEFAULT_CONFIG
    t0 = time.perf_counter()
    code = cmd_train(args)
    print(f"demo wall time: {time.perf_counter() - t0:.0f}s", flush=True)
    return code


def cmd_nightly(args) -> int:
    with prefect_api(args.store if "://" not in args.store else ".rlstage"):
        from flows.nightly import nightly

        result = nightly(run_name=args.run, iterations=args.iterations, store_root=args.store)
    _summary(result)
    return 0


def cmd_replay(args) -> int:
    with prefect_api(args.store if "://" not in args.store else ".rlstage"):
        from flows.replay import format_summary, replay

        summary = replay(
            run_name=args.run, iteration=args.iteration, stage=args.stage, store_root=args.store, overrides=args.overrides
        )
    print(format_summary(summary))
    return 0


def cmd_eval(args) -> int:
    with prefect_api(args.store if "://" not in args.store else ".rlstage"):
        from flows.evaluate import evaluate_run

        result = evaluate_run(
            run_name=args.run, iteration=args.iteration, store_root=args.store, overrides=args.overrides
        )
    state = "evaluated" if result["executed"] else "already evaluated (committed)"
    print(f"{state}: policy of iteration {result['iteration']} of run {result['run']} -> {result['artifact']}")
    for k, v in sorted(result["metrics"].items()):
        print(f"  {k}: {v:.4g}")
    return 0


def cmd_data_prep(args) -> int:
    cfg = _load(args)
    with prefect_api(cfg.store.root if "://" not in cfg.store.root else ".rlstage"):
        from flows.data_prep import prepare_data

        result = prepare_data(config=cfg)
    print(f"prompts of run {result['run']}: {result['train_rows']} train, {result['test_rows']} test")
    print(f"  {result['train']}\n  {result['test']}")
    return 0


def cmd_compare(args) -> int:
    from flows.compare import main as compare_main

    return compare_main(args.rest)


def cmd_inspect(args) -> int:
    import polars as pl

    from infra.explore import Experience, run_query
    from infra.store import ArtifactStore

    exp = Experience.open(ArtifactStore(args.store), args.run, None if args.iteration is None else [args.iteration])
    frame = run_query(exp, args.query, args.limit).collect()
    with pl.Config(tbl_rows=-1, tbl_cols=-1, fmt_str_lengths=40, tbl_width_chars=200, tbl_hide_dataframe_shape=True):
        print(frame)
    return 0


def _summary(result: dict) -> None:
    hist = [h for h in result["history"] if "val/accuracy" in h]
    print("\nheld-out accuracy (greedy, exact match):")
    for h in hist:
        print(f"  iteration {h['iteration']:>3}: {h['val/accuracy']:.3f}")
    if len(hist) >= 2:
        gain = hist[-1]["val/accuracy"] - hist[0]["val/accuracy"]
        print(f"learning: {hist[0]['val/accuracy']:.3f} -> {hist[-1]['val/accuracy']:.3f} ({gain * 100:+.1f} points)")
    print(f"artifacts: {result['store']}/{result['run']}")
    print(f"mlflow: {result['mlflow']}")


def main(argv: list[str] | None = None) -> int:
    apply_defaults()
    parser = argparse.ArgumentParser(prog="rlstage", description="RL post-training as Prefect stages on Ray")
    sub = parser.add_subparsers(dest="cmd", required=True)
    for name, fn, helptext in (
        ("demo", cmd_demo, "tiny kit + GRPO on CPU through Prefect, Ray, the store and MLflow"),
        ("train", cmd_train, "a training run from a config (continues where it stopped)"),
    ):
        p = sub.add_parser(name, help=helptext)
        p.add_argument("-c", "--config", type=Path, default=None, help="YAML config (default: the demo's)")
        p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. actor.optim.lr=1e-5")
        p.set_defaults(fn=fn)
    p = sub.add_parser("nightly", help="continue a run by K iterations with its stored config")
    p.add_argument("run")
    p.add_argument("-k", "--iterations", type=int, default=1)
    p.add_argument("--store", default="./rlstage-runs", help="store root of the run")
    p.set_defaults(fn=cmd_nightly)
    p = sub.add_parser("replay", help="re-execute one stage of one iteration from its stored inputs")
    p.add_argument("run")
    p.add_argument("iteration", type=int)
    p.add_argument("stage")
    p.add_argument("overrides", nargs="*", help="changed settings, e.g. reward.function=gsm8k_flexible")
    p.add_argument("--store", default="./rlstage-runs", help="store root of the run")
    p.set_defaults(fn=cmd_replay)
    p = sub.add_parser("eval", help="evaluate a stored policy of a run (default: its last iteration)")
    p.add_argument("run")
    p.add_argument("-i", "--iteration", type=int, default=None)
    p.add_argument("overrides", nargs="*", help="changed eval settings, e.g. trainer.eval_n=16")
    p.add_argument("--store", default="./rlstage-runs", help="store root of the run")
    p.set_defaults(fn=cmd_eval)
    p = sub.add_parser("data-prep", help="commit a run's prompts artifact (train/test splits)")
    p.add_argument("-c", "--config", type=Path, default=None, help="YAML config (default: built-in defaults)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. data.source=gsm8k")
    p.set_defaults(fn=cmd_data_prep)
    p = sub.add_parser("compare", help="compare runs from MLflow: table + PNG of curves")
    p.add_argument("rest", nargs=argparse.REMAINDER, help="RUN [RUN ...] [--tracking-uri URI] [--png out.png]")
    p.set_defaults(fn=cmd_compare)
    from infra.explore import QUERIES

    p = sub.add_parser("inspect", help="query a run's rollouts, rewards and experience (polars)")
    p.add_argument("run")
    p.add_argument("-q", "--query", choices=list(QUERIES), default="rewards", help="default: %(default)s")
    p.add_argument("-i", "--iteration", type=int, default=None, help="one iteration (default: all)")
    p.add_argument("-n", "--limit", type=int, default=10, help="rows of best/worst/logprob-gap (default: 10)")
    p.add_argument("--store", default="./rlstage-runs", help="store root of the run (default: %(default)s)")
    p.set_defaults(fn=cmd_inspect)
    args = parser.parse_args(argv)
    from infra.lease import RunLocked
    from infra.store import StoreError
    from infra.tracking import TrackingUnavailable
    from schemas.config import ConfigError

    try:
        return args.fn(args)
    except (ConfigError, FileNotFoundError, StoreError, RunLocked, TrackingUnavailable) as err:
        print(f"rlstage: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
