"""Long nightly operation: many continuations of the tiny demo, each one `rlstage nightly` as a schedule runs it.

    .venv/bin/python bench/nightlies.py [--nights 100] [--dir /tmp/rlstage-nightlies] [overrides...]

In ``--dir`` (the commands' working directory: their home ``.rlstage/`` with the Prefect and MLflow databases lies
under it) ``rlstage train`` runs configs/demo.yaml for one iteration with a constant lr (a decaying one ends a run
at its length) and the retention of ``--keep`` checkpoints, then ``--nights`` times ``rlstage nightly RUN -k 1``.
After each command: one JSON line (night, the run's last iteration, seconds, the store's bytes split into the
update stages' (checkpoints: weights and trainer state) and the rest, the Prefect and MLflow databases' bytes).
Then a summary: what retention predicts for the store (the SFT kit and the first run, plus the rest's bytes per
iteration times the iterations, plus ``--keep`` checkpoints) against what it holds, and for each database its
growth per night and how close that is to a line (R² of a least-squares fit; 1 is linear).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUN = "nightly-bench"


def tree_bytes(path: Path, under_update: bool | None = None) -> int:
    """Bytes of the files under ``path``; only those in (or not in) an ``update`` stage's folder if asked."""
    total = 0
    for dirpath, _, files in os.walk(path):
        if under_update is not None and ("/update" in dirpath.replace(str(path), "")) != under_update:
            continue
        total += sum((Path(dirpath) / f).stat().st_size for f in files if (Path(dirpath) / f).is_file())
    return total


def db_bytes(path: Path) -> int:
    """A SQLite database with its write-ahead log."""
    return sum(p.stat().st_size for p in path.parent.glob(path.name + "*") if p.is_file())


def fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Slope and R² of the least-squares line through (xs, ys)."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
    slope = sxy / sxx if sxx else 0.0
    ss_res = sum((y - my - slope * (x - mx)) ** 2 for x, y in zip(xs, ys, strict=True))
    ss_tot = sum((y - my) ** 2 for y in ys)
    return slope, (1 - ss_res / ss_tot) if ss_tot else 1.0


def run(cmd: list[str], cwd: Path) -> float:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PREFECT_LOGGING_LEVEL": "WARNING"}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"{' '.join(cmd[1:3])} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("overrides", nargs="*", help="dotted overrides on top of configs/demo.yaml")
    parser.add_argument("--nights", type=int, default=100)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/rlstage-nightlies"))
    parser.add_argument("--keep", type=int, default=2, help="trainer.max_actor_ckpt_to_keep")
    args = parser.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    store = args.dir / "store"
    rlstage = str(ROOT / ".venv" / "bin" / "rlstage")
    first = [
        rlstage, "train", "-c", str(ROOT / "configs" / "demo.yaml"), f"run_name={RUN}", f"store.root={store}",
        "trainer.iterations=1", "actor.optim.lr_schedule=constant", f"trainer.max_actor_ckpt_to_keep={args.keep}",
        "trainer.eval_every=10", *args.overrides,
    ]  # fmt: skip
    rows = []
    for night in range(args.nights + 1):
        cmd = first if night == 0 else [rlstage, "nightly", RUN, "-k", "1", "--store", str(store)]
        seconds = run(cmd, args.dir)
        row = {
            "night": night,
            "iteration": 1 + night,
            "seconds": round(seconds, 1),
            "store_checkpoint_bytes": tree_bytes(store, under_update=True),
            "store_other_bytes": tree_bytes(store, under_update=False),
            "prefect_db_bytes": db_bytes(args.dir / ".rlstage" / "prefect" / "prefect.db"),
            "mlflow_db_bytes": db_bytes(args.dir / ".rlstage" / "mlflow" / "mlflow.db"),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    nights = [float(r["night"]) for r in rows[1:]]
    summary: dict = {"nights": args.nights, "keep": args.keep}
    other_slope, other_r2 = fit(nights, [float(r["store_other_bytes"]) for r in rows[1:]])
    checkpoint = rows[0]["store_checkpoint_bytes"]  # the first run's one update: one checkpoint
    predicted = rows[0]["store_other_bytes"] + other_slope * args.nights + args.keep * checkpoint
    actual = rows[-1]["store_other_bytes"] + rows[-1]["store_checkpoint_bytes"]
    summary["store"] = {
        "bytes": actual,
        "predicted_bytes": round(predicted),
        "ratio": round(actual / predicted, 3),
        "checkpoint_bytes_max": max(r["store_checkpoint_bytes"] for r in rows),
        "other_bytes_per_night": round(other_slope),
        "other_r2": round(other_r2, 4),
    }
    for key in ("prefect_db_bytes", "mlflow_db_bytes"):
        slope, r2 = fit(nights, [float(r[key]) for r in rows[1:]])
        summary[key.removesuffix("_bytes")] = {"first": rows[0][key], "last": rows[-1][key], "per_night": round(slope), "r2": round(r2, 4)}
    summary["seconds_per_night_median"] = statistics.median(r["seconds"] for r in rows[1:])
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
