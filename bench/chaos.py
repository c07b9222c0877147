"""Chaos, longer: tests/integration/test_chaos.py's run under many seeded schedules, one after another.

    .venv/bin/python bench/chaos.py --seeds 0 1 2 3 4 5 6 7 8 9

Each seed draws ``--kills`` kills (default four; CI's test draws three) of distinct kinds (the command, its Prefect server, a trainer worker, the rollout
worker, a stage task's process) at random iterations; the test restarts the command after each death until it
completes, then compares every artifact with an undisturbed run's, MLflow's steps, Prefect's states and the
processes left. One JSON line per seed (its schedule, the attempts' exit codes, passed or the failure's first
assertion line and the folder its run is kept in), then the totals.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TEST = "tests/integration/test_chaos.py::test_a_run_killed_at_random_is_the_run_undisturbed"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=list(range(10)), help="one schedule per seed")
    parser.add_argument("--kills", type=int, default=4, help="kills of distinct kinds per schedule (1..5)")
    parser.add_argument("--out", type=Path, default=None, help="also append the JSON lines to this file")
    args = parser.parse_args(argv)
    passed = 0
    for seed in args.seeds:
        t0 = time.perf_counter()
        env = {**os.environ, "RLSTAGE_CHAOS_SEED": str(seed), "RLSTAGE_CHAOS_KILLS": str(args.kills)}
        # a folder of its own per schedule, kept when it fails (pytest's own keeps only its last three runs)
        kept = Path(tempfile.mkdtemp(prefix=f"rlstage-chaos-seed{seed}-"))
        pytest = [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider"]
        cmd = [*pytest, f"--basetemp={kept}", TEST]
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
        out, ok = proc.stdout + proc.stderr, proc.returncode == 0
        if ok:
            shutil.rmtree(kept, ignore_errors=True)
        found = re.search(r"^chaos schedule: (.*)$", out, re.M)
        codes = re.search(r"^exit codes of the attempts: (.*)$", out, re.M)
        lines = out.splitlines()
        # the first assertion line says what differed; the FAILED line alone names only the test
        asserted = [ln for ln in lines if ln.startswith("E ")][:1]
        failure = asserted or [ln for ln in lines if ln.startswith("FAILED")][-1:]
        row = {
            "seed": seed,
            "schedule": found.group(1) if found else None,
            "exit_codes": codes.group(1) if codes else None,
            "passed": ok,
            "failure": failure[0] if failure else None,
            "kept": None if ok else str(kept),  # a failed run's stores, homes, databases
            "seconds": round(time.perf_counter() - t0, 1),
        }
        passed += row["passed"]
        line = json.dumps(row)
        print(line, flush=True)
        if args.out is not None:
            with args.out.open("a") as f:
                f.write(line + "\n")
    print(json.dumps({"schedules": len(args.seeds), "kills_each": args.kills, "passed": passed}))
    return 0 if passed == len(args.seeds) else 1


if __name__ == "__main__":
    sys.exit(main())
