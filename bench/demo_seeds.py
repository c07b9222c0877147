"""A demo over several seeds: does every seed reach the target, and how spread are they?

    .venv/bin/python bench/demo_seeds.py [--seeds 0 1 2 3 4] [--store /tmp/rlstage-demo-seeds] [overrides...]
    .venv/bin/python bench/demo_seeds.py --real --seeds 0 1 2 --target 0.47    # the second demo

Each seed runs ``rlstage demo`` (configs/demo.yaml plus the overrides) as a new user would, with
``trainer.seed`` and ``sft.seed`` both set to it, so the SFT start differs per seed too (its checkpoint
is trained once per seed and reused on a rerun with the same store). ``--real`` runs the second demo
instead (``rlstage train -c configs/reasoning-smollm2.yaml`` on the fetched SmolLM2) with ``trainer.seed``,
``rollout.seed`` and ``data.shuffle_seed`` set to the seed; its held-out split stays the same. Prints one
JSON line per seed (start, final and best held-out accuracy, the first evaluated iteration at or above the
target and the wall seconds from the end of iteration 0 until it, wall seconds of the whole command, the
median seconds of an iteration, the peak memory (PSS) of the command and everything it started), then one
line with the median and range over the seeds.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EVAL_LINE = re.compile(r"^\s+iteration\s+(\d+): ([0-9.]+)")  # flows/cli.py _summary
ITERATION_LINE = re.compile(r"^iteration\s+(\d+): .*\| ([0-9.]+)s, executed")  # flows/terminal.py
HELD_OUT = re.compile(r"held-out accuracy ([0-9.]+)")
REAL_CONFIG = "configs/reasoning-smollm2.yaml"
from vs_trl import median_time, overrides_tag  # noqa: E402  (bench/ is the script's own folder, as for vs_trl_real.py)


def tree_pss_bytes(owner: int) -> int:
    """Memory of a command and of every process it started (they carry its RLSTAGE_OWNER_PID): the sum of their
    proportional set sizes, so that pages the processes share (torch's libraries, a model mapped by several)
    count once, not once per process as in a sum of RSS."""
    from rlstage.infra.home import OWNER_ENV, process_environs

    total = 0
    for pid, env in process_environs():
        if pid == owner or env.get(OWNER_ENV.encode()) == str(owner).encode():
            try:
                pss = next(ln for ln in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines() if ln.startswith("Pss:"))
            except (OSError, StopIteration):  # gone meanwhile, or a zombie
                continue
            total += int(pss.split()[1]) * 1024
    return total


def command(seed: int, store: str, real: bool, overrides: list[str] = ()) -> list[str]:
    rlstage = str(ROOT / ".venv" / "bin" / "rlstage")
    # one run per overrides and seed: another setting is another run beside it in the store (the kit's SFT shared)
    tag = f"-{overrides_tag(overrides)}" if overrides else ""
    if not real:
        return [rlstage, "demo", f"run_name=demo{tag}-seed{seed}", f"store.root={store}", f"trainer.seed={seed}", f"sft.seed={seed}"]
    model = subprocess.run(
        [str(ROOT / ".venv" / "bin" / "python"), "-m", "rlstage.infra.models", "smollm2"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout.split()[-1]  # fmt: skip
    return [
        rlstage, "train", "-c", REAL_CONFIG, model, f"run_name=real{tag}-seed{seed}", f"store.root={store}",
        f"trainer.seed={seed}", f"rollout.seed={seed}", f"data.shuffle_seed={seed}",
    ]  # fmt: skip


def run_seed(seed: int, store: str, target: float, overrides: list[str], real: bool = False) -> dict:
    cmd = [*command(seed, store, real, overrides), *overrides]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", "PREFECT_LOGGING_LEVEL": "WARNING"}
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak = [0]

    def sample() -> None:  # every 2 s while it runs: the peak of the whole tree, Ray's workers included
        while proc.poll() is None:
            peak[0] = max(peak[0], tree_pss_bytes(proc.pid))
            time.sleep(2)

    lines: list[tuple[float, str]] = []  # the terminal's progress lines (stderr) as they arrive: when each iteration ended

    def read_progress() -> None:
        for line in proc.stderr:
            lines.append((time.perf_counter(), line))

    sampler = threading.Thread(target=sample, daemon=True)
    reader = threading.Thread(target=read_progress, daemon=True)
    sampler.start()
    reader.start()
    stdout = proc.stdout.read()
    proc.wait()
    wall = time.perf_counter() - t0
    sampler.join()
    reader.join()
    stderr = "".join(line for _t, line in lines)
    proc = subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
    if proc.returncode:
        sys.exit(f"seed {seed}: rlstage demo failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    curve = [(int(m[1]), float(m[2])) for m in map(EVAL_LINE.match, proc.stdout.splitlines()) if m]
    if not curve:
        sys.exit(f"seed {seed}: no held-out accuracy in the demo's output:\n{proc.stdout[-2000:]}")
    return {
        "seed": seed,
        "start": curve[0][1],
        "final": curve[-1][1],
        "best": max(a for _i, a in curve),
        "iterations_to_target": next((i for i, a in curve if a >= target), None),
        "seconds_to_target": seconds_to_target(lines, target),
        "wall_s": round(wall, 1),
        "iteration_s": statistics.median(t) if (t := iteration_seconds(proc.stderr)) else None,  # the terminal's lines
        "peak_pss_gib": round(peak[0] / 2**30, 2),
        "curve": curve,
    }


def seconds_to_target(lines: list[tuple[float, str]], target: float) -> float | None:
    """Wall seconds from the end of iteration 0 (the start policy's eval) to the first iteration line whose held-out
    accuracy reaches the target: what a user waits, whatever overlaps inside (pipelined iterations included)."""
    ends = [(t, m) for t, line in lines if (m := ITERATION_LINE.match(line))]
    start = next((t for t, m in ends if int(m[1]) == 0), None)
    hit = next((t for t, m in ends if (a := HELD_OUT.search(m[0])) and float(a[1]) >= target and int(m[1]) > 0), None)
    return round(hit - start, 1) if start is not None and hit is not None else None


def iteration_seconds(stdout: str) -> list[float]:
    """Seconds of each training iteration (iteration 0 is the base model's eval only)."""
    return [float(m[2]) for m in map(ITERATION_LINE.match, stdout.splitlines()) if m and int(m[1]) > 0]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("overrides", nargs="*", help="dotted overrides on top of configs/demo.yaml")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--store", default="/tmp/rlstage-demo-seeds")
    parser.add_argument("--target", type=float, default=0.8)
    parser.add_argument("--real", action="store_true", help=f"the second demo ({REAL_CONFIG}) instead of the tiny one")
    args = parser.parse_args()
    rows = []
    for seed in args.seeds:
        rows.append(run_seed(seed, args.store, args.target, args.overrides, args.real))
        print(json.dumps(rows[-1]), flush=True)
    summary: dict = {"seeds": len(rows), "target": args.target}
    for key in ("start", "final", "best", "wall_s", "iteration_s", "peak_pss_gib"):
        vals = [r[key] for r in rows]
        summary[key] = {"median": statistics.median(vals), "min": min(vals), "max": max(vals)}
    # a seed short of the target counts as slower than any that reached it (null: the median seed did not)
    summary["seconds_to_target"] = {"median": median_time([r["seconds_to_target"] for r in rows]), "per_seed": [r["seconds_to_target"] for r in rows]}
    summary["all_reach_target"] = all(r["iterations_to_target"] is not None for r in rows)
    summary["final_all_above_target"] = all(r["final"] >= args.target for r in rows)
    summary["gain_points"] = [round((r["final"] - r["start"]) * 100, 1) for r in rows]
    summary["final_within_3_points_of_best"] = all(r["best"] - r["final"] <= 0.03 + 1e-9 for r in rows)
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
