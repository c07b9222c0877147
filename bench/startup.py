"""A command's start-up: seconds from ``rlstage train`` starting to its first committed stage, and the machine's
CPU-seconds for a whole 2-iteration tiny-kit run, on a cold home and on a warm one.

- ``cold``: a new home (``RLSTAGE_HOME``) with nothing running: the command starts its own Prefect server, Ray and
  MLflow store (migrations included) and its worker.
- ``warm``: the same command on a home where ``rlstage ui`` runs (its Prefect and MLflow servers), after one run
  of it there (databases migrated, the kit's SFT committed in the same store, so the run trains anew under
  another run name).
- ``stack``: as ``warm``, on a home where ``infra/stack.sh up`` runs (its Prefect and MLflow servers and its Ray
  head): the command joins that Ray and takes the worker the run before released.

CPU-seconds are the whole machine's (/proc/stat, user + nice + system) over the command: run it alone.

    .venv/bin/python bench/startup.py                 # 3 repeats of each, one JSON line per run, then medians
    .venv/bin/python bench/startup.py --variants cold,warm,stack --repeats 2
    .venv/bin/python bench/startup.py --repeats 1 --variants cold
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from rlstage.infra.store import ArtifactStore  # noqa: E402
from tests_support import tiny_overrides  # noqa: E402  (the tests' tiny-kit settings: a run of seconds)

RLSTAGE = str(REPO / ".venv" / "bin" / "rlstage")


def cpu_seconds() -> float:
    """The machine's busy CPU time so far (user + nice + system of every core)."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    return sum(int(v) for v in fields[:3]) / os.sysconf("SC_CLK_TCK")


def one_run(home: Path, store: Path, run: str) -> dict:
    env = {**os.environ, "RLSTAGE_HOME": str(home)}
    for k in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI"):
        env.pop(k, None)
    args = [RLSTAGE, "train", f"store.root={store}", f"run_name={run}", *tiny_overrides()]
    st = ArtifactStore(str(store))
    cpu0, t0 = cpu_seconds(), time.perf_counter()
    proc = subprocess.Popen(args, env=env, cwd=home.parent, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    first = None
    while proc.poll() is None:
        if first is None and st.manifest(run, None, "data_prep") is not None:
            first = time.perf_counter() - t0
        time.sleep(0.05)
    wall, cpu = time.perf_counter() - t0, cpu_seconds() - cpu0
    if proc.returncode != 0:
        raise SystemExit(f"rlstage train failed ({proc.returncode}): {proc.stderr.read()[-2000:]}")
    return {"first_stage_s": round(first if first is not None else wall, 2), "wall_s": round(wall, 2), "cpu_s": round(cpu, 1)}


def warm_home(work: Path) -> tuple[Path, subprocess.Popen]:
    """A home where ``rlstage ui`` runs, once it answers, with one run trained there already."""
    from rlstage.infra import home as h

    home = work / "warm-home"
    env = {**os.environ, "RLSTAGE_HOME": str(home)}
    ui = subprocess.Popen([RLSTAGE, "ui"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    os.environ["RLSTAGE_HOME"] = str(home)
    deadline = time.monotonic() + 120
    while not (h.running_service(h.PREFECT_SERVICE) and h.running_service(h.MLFLOW_SERVICE)):
        if time.monotonic() > deadline or ui.poll() is not None:
            raise SystemExit("rlstage ui did not come up")
        time.sleep(0.5)
    one_run(home, work / "warm-store", "first")
    return home, ui


def stack_home(work: Path) -> Path:
    """A home where ``infra/stack.sh up`` runs, with one run trained there already (its worker idle on the stack's Ray)."""
    home = work / "stack-home"
    env = {**os.environ, "RLSTAGE_HOME": str(home), "PREFECT_UI_ENABLED": "false"}
    subprocess.run(["bash", str(REPO / "infra" / "stack.sh"), "up"], env=env, check=True, stdout=subprocess.DEVNULL)
    one_run(home, work / "stack-store", "first")
    return home


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--variants", default="cold,warm")
    a = p.parse_args()
    rows: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="rlstage-startup-") as tmp:
        work = Path(tmp)
        if "cold" in a.variants:
            for i in range(a.repeats):
                row = {"variant": "cold", "repeat": i, **one_run(work / f"cold-home-{i}", work / f"cold-store-{i}", "s")}
                rows.setdefault("cold", []).append(row)
                print(json.dumps(row), flush=True)

        def on(variant: str, home: Path) -> None:  # the repeats on a home whose services run already
            for i in range(a.repeats):
                row = {"variant": variant, "repeat": i, **one_run(home, work / f"{variant}-store", f"s{i}")}
                rows.setdefault(variant, []).append(row)
                print(json.dumps(row), flush=True)

        if "warm" in a.variants:
            home, ui = warm_home(work)
            try:
                on("warm", home)
            finally:
                os.killpg(ui.pid, 15)
                ui.wait(timeout=60)
        if "stack" in a.variants:
            home = stack_home(work)
            try:
                on("stack", home)
            finally:
                env = {**os.environ, "RLSTAGE_HOME": str(home)}
                subprocess.run(["bash", str(REPO / "infra" / "stack.sh"), "down"], env=env, stdout=subprocess.DEVNULL)
    for variant, rs in rows.items():
        med = {k: statistics.median(r[k] for r in rs) for k in ("first_stage_s", "wall_s", "cpu_s")}
        print(json.dumps({"variant": variant, "median": med, "runs": len(rs)}))


if __name__ == "__main__":
    main()
