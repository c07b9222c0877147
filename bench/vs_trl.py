"""rlstage against TRL's GRPOTrainer from the same SFT checkpoint: held-out accuracy against training seconds.

    .venv/bin/python bench/vs_trl.py [--seeds 0 1 2] [--config configs/race.yaml] [--store /tmp/rlstage-vs-trl]
                                     [--trl-steps 2000] [--target 0.85] [overrides...]
    .venv/bin/python bench/vs_trl.py --config configs/race-top.yaml --target 0.92    # the race to TRL's end of run

For each seed, back to back on this machine: rlstage runs the config (plus the overrides) through the
real pipeline (its own Prefect server, Ray, store and MLflow, in a child process), which builds or reuses
the kit's SFT checkpoint; then TRL 1.16's ``GRPOTrainer`` (bench/trl_grpo.py, in a virtual environment of
the bench's own under ``bench/.trl-venv``, with the project's torch and transformers) trains from that
same checkpoint on the same stored splits, with the same reward function and the same greedy eval of the
held-out prompts. Evaluation time is left out on both sides; for rlstage everything else counts
(orchestration, store, tracking: each iteration's whole wall less its eval stage). Setup (starting the
services, loading the model, the SFT) counts on neither side and is printed as ``setup_s``.

Prints one JSON line per run (system, seed, the curve as [[training seconds, accuracy], ...], the first
point at or above the target, the final accuracy), then one summary line: each side's median
time-to-target over the seeds and their ratio (rlstage / TRL).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata as md
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TRL_VENV = ROOT / "bench" / ".trl-venv"
TRL_VERSION = "1.16.0"
STAGE_TIMINGS = [f"timing_s/{s}" for s in ("rollout", "filter_groups", "reward", "advantage", "update", "eval", "iteration")]


def trl_python() -> Path:
    """The bench's TRL environment (created once): TRL beside the project's own torch and transformers."""
    py = TRL_VENV / "bin" / "python"
    pins = [f"torch=={md.version('torch').split('+')[0]}", f"transformers=={md.version('transformers')}", f"trl=={TRL_VERSION}"]
    if py.exists() and subprocess.run([py, "-c", f"import trl; assert trl.__version__ == '{TRL_VERSION}'"]).returncode == 0:
        return py
    print(f"installing {' '.join(pins)} into {TRL_VENV} (once) ...", file=sys.stderr, flush=True)
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", str(TRL_VENV)], check=True)
    index = os.environ.get("TORCH_INDEX")  # as scripts/setup.sh: the CPU build elsewhere
    subprocess.run([py, "-m", "pip", "install", "-q", *pins, *(["--extra-index-url", index] if index else [])], check=True)
    return py


def first_at(curve: list[list[float]], target: float) -> float | None:
    return next((t for t, acc, *_ in curve if acc >= target), None)


def overrides_tag(overrides: list[str]) -> str:
    """Six hex digits naming a list of overrides: a run per setting, beside the others in one store."""
    return hashlib.sha1(json.dumps(list(overrides)).encode()).hexdigest()[:6]


def median_time(times: list[float | None]) -> float | None:
    """The median time-to-target, a seed that never reached it counting as slower than any that did."""
    m = statistics.median(t if t is not None else float("inf") for t in times)
    return None if m == float("inf") else m


def run_rlstage(args: argparse.Namespace, seed: int, out: Path) -> dict:
    """One seed of rlstage, in this process (the ``--side rlstage`` child): the curve from the run's history."""
    sys.path.insert(0, str(ROOT))
    from rlstage.flows.cli import prefect_api
    from rlstage.infra.env import apply_defaults
    from rlstage.infra.store import ArtifactStore
    from rlstage.schemas.stages import kit_run_name

    apply_defaults()
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    t0 = time.perf_counter()
    with prefect_api():
        from rlstage.flows.training import train
        from rlstage.schemas.config import load_config

        # One run per config, overrides and seed: another setting is another run, never a refused resume.
        tag = overrides_tag(args.overrides) if args.overrides else "base"
        run = f"vs-trl-{Path(args.config).stem}-{tag}-seed{seed}"
        cfg = load_config(ROOT / args.config, [*args.overrides, f"store.root={args.store}", f"run_name={run}", f"trainer.seed={seed}"])
        result = train(config=cfg)
    store = ArtifactStore(args.store)  # local: TRL reads the checkpoint folder and the splits in place
    curve, spent = [], 0.0
    for h in result["history"]:
        spent += h["wall_s"] - h.get("timing_s/eval", 0.0)
        if "val/accuracy" in h:
            curve.append([round(spent, 3), h["val/accuracy"], h["iteration"]])
    steady = [h for h in result["history"] if h["iteration"] >= 2] or result["history"]  # 1 loads the workers
    split = {k[len("timing_s/") :]: statistics.median(h.get(k, 0.0) for h in steady) for k in STAGE_TIMINGS}
    split["outside_stages"] = statistics.median(h["wall_s"] - h.get("timing_s/iteration", 0.0) for h in steady)
    # what is not engine compute (each stage's manifest records its own), as a share of the whole wall
    compute = [(1 - h.get("timing_s/orchestration_share", 0.0)) * h.get("timing_s/iteration", 0.0) for h in steady]
    not_compute = statistics.median(1 - c / h["wall_s"] for c, h in zip(compute, steady, strict=True))
    row = {
        "system": "rlstage",
        "cores": rlstage_cores(cfg),
        "config": args.config,
        "overrides": args.overrides,
        "seed": seed,
        "curve": curve,
        "train_s": curve[-1][0],
        "eval_s": round(sum(h.get("timing_s/eval", 0.0) for h in result["history"]), 1),
        "setup_s": round(time.perf_counter() - t0 - sum(h["wall_s"] for h in result["history"]), 1),
        "median_iteration_split_s": {k: round(v, 3) for k, v in split.items()},
        "median_orchestration_io_share": round(not_compute, 3),
        "sft_model": str(Path(store.artifact_dir(kit_run_name(cfg), None, "sft")) / "model"),
        "data": store.artifact_dir(cfg.run_name, None, "data_prep"),
    }
    out.write_text(json.dumps(row))
    return row


def rlstage_cores(cfg) -> int:
    """The CPU cores rlstage's side computes on: its local Ray's (ray.num_cpus, else the machine's)."""
    return min(cfg.ray.num_cpus or os.cpu_count(), os.cpu_count())


def side(cmd: list, out: Path) -> dict:
    proc = subprocess.run([str(c) for c in cmd], cwd=ROOT, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"{' '.join(map(str, cmd[:3]))} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("overrides", nargs="*", help="dotted overrides on top of the config")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--config", default="configs/race.yaml")
    parser.add_argument("--store", default="/tmp/rlstage-vs-trl")
    parser.add_argument("--trl-steps", type=int, default=2000)
    parser.add_argument("--trl-eval-every", type=int, default=25)
    # fp32: on this CPU TRL's default bf16 autocast was slower per step (0.22 s vs 0.18 s) and no better per step
    parser.add_argument("--trl-precision", choices=["default", "fp32"], default="fp32")
    parser.add_argument("--target", type=float, default=0.85)
    parser.add_argument("--only", choices=["rlstage", "trl"], help="run one side (TRL needs the store's SFT checkpoint)")
    parser.add_argument("--side", choices=["rlstage"], help=argparse.SUPPRESS)  # the child that runs one rlstage seed
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        run_rlstage(args, args.seeds[0], Path(args.out))
        return
    py = trl_python() if args.only != "rlstage" else None
    work = Path(args.store) / "vs-trl"
    work.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    for seed in args.seeds:
        # rlstage first: its run builds (or reuses) the SFT checkpoint TRL starts from.
        out = work / f"rlstage-seed{seed}.json"
        if args.only != "trl":
            cmd = [sys.executable, __file__, "--side", "rlstage", "--seeds", seed, "--config", args.config, "--store", args.store]
            ours = side([*cmd, "--out", out, *args.overrides], out)
        else:
            ours = json.loads(out.read_text())
        runs = [ours] if args.only != "trl" else []
        if py is not None:
            trl_out = work / f"trl-seed{seed}.json"
            runs.append(
                side(
                    [py, ROOT / "bench" / "trl_grpo.py", "--model", ours["sft_model"], "--data", ours["data"],
                     "--seed", seed, "--steps", args.trl_steps, "--eval-every", args.trl_eval_every, "--precision", args.trl_precision,
                     "--threads", ours["cores"], "--out", trl_out],
                    trl_out,
                )
            )  # fmt: skip
        for r in runs:
            r |= {"time_to_target_s": first_at(r["curve"], args.target), "final": r["curve"][-1][1], "target": args.target}
            print(json.dumps(r), flush=True)
        rows += runs
    # equal cores, always: TRL's torch threads are the cores rlstage's side uses (both in every line)
    summary: dict = {"target": args.target, "seeds": args.seeds, "cores": {r["system"]: r.get("cores", r.get("threads")) for r in rows}}
    for system in ("rlstage", "trl"):
        times = [r["time_to_target_s"] for r in rows if r["system"] == system]
        if times:
            reached = [t for t in times if t is not None]
            summary[system] = {
                "time_to_target_s": times,
                "median_s": median_time(times),
                "reached": f"{len(reached)}/{len(times)}",
                "final": [r["final"] for r in rows if r["system"] == system],
            }
    if summary.get("rlstage", {}).get("median_s") and summary.get("trl", {}).get("median_s"):
        summary["ratio_rlstage_over_trl"] = round(summary["rlstage"]["median_s"] / summary["trl"]["median_s"], 3)
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
