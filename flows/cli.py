"""The ``rlstage`` command: demo, train (more verbs live in their flows)."""

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
    args = parser.parse_args(argv)
    from schemas.config import ConfigError

    try:
        return args.fn(args)
    except (ConfigError, FileNotFoundError) as err:
        print(f"rlstage: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
