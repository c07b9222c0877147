"""Refresh the docs' screenshots from a real run, in one command (headless Chromium: Debian's `chromium`).

    .venv/bin/python scripts/screenshots.py                 # docs/ui-prefect.png, docs/ui-mlflow.png
    .venv/bin/python scripts/screenshots.py --site out/     # also the built docs site's reference pages

A short run of the tiny kit trains in a temporary home; `rlstage ui` serves its Prefect and MLflow UIs;
Chromium photographs the training flow run's page and the MLflow run's charts. Nothing of the user's home is read.
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
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RUN = ["trainer.iterations=4", "kit.train_size=2000", "kit.test_size=200", "run_name=demo"]


def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        sys.exit("screenshots: no chromium on PATH (Debian: apt-get install chromium)")
    return found


def shoot(url: str, out: Path, size: str = "1400,900", wait_ms: int = 15000) -> None:
    """One page, rendered for ``wait_ms`` of virtual time, as a PNG."""
    profile = tempfile.mkdtemp(prefix="rlstage-chromium-")
    try:
        subprocess.run(
            [
                chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--hide-scrollbars", f"--user-data-dir={profile}", f"--window-size={size}",
                f"--virtual-time-budget={wait_ms}", f"--screenshot={out}", url,
            ],  # fmt: skip
            check=True, capture_output=True, timeout=120,
        )  # fmt: skip
    finally:
        shutil.rmtree(profile, ignore_errors=True)
    print(f"wrote {out}")


def _post(url: str, body: dict) -> list:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def ui_screenshots(docs: Path) -> None:
    work = Path(tempfile.mkdtemp(prefix="rlstage-screens-"))
    env = {**os.environ, "RLSTAGE_HOME": str(work / ".rlstage")}
    cli = [sys.executable, "-m", "rlstage.flows.cli"]
    subprocess.run([*cli, "demo", *RUN], cwd=work, env=env, check=True)
    from rlstage.infra.env import free_port

    ports = ["--prefect-port", str(free_port()), "--mlflow-port", str(free_port())]
    ui = subprocess.Popen([*cli, "ui", *ports], cwd=work, env=env, stdout=subprocess.PIPE, text=True)
    try:
        urls = {}
        while len(urls) < 2:
            line = ui.stdout.readline()
            if not line:
                sys.exit("screenshots: rlstage ui exited before printing its URLs")
            if m := re.match(r"(Prefect|MLflow) UI:\s+(\S+)", line):
                urls[m.group(1)] = m.group(2)
        prefect = urls["Prefect"]
        runs = _post(f"{prefect}/api/flow_runs/filter", {"flow_runs": {"parent_task_run_id": {"is_null_": True}}, "sort": "START_TIME_ASC"})
        train = next(r for r in runs if r.get("name", "").startswith("demo"))
        shoot(f"{prefect}/runs/flow-run/{train['id']}", docs / "ui-prefect.png")
        mlflow = urls["MLflow"].split("/#/")[0]
        experiments = _post(f"{mlflow}/api/2.0/mlflow/experiments/search", {"max_results": 10})["experiments"]
        exp = next(e for e in experiments if e["name"] != "Default")
        found = _post(f"{mlflow}/api/2.0/mlflow/runs/search", {"experiment_ids": [exp["experiment_id"]], "max_results": 1})
        run_id = found["runs"][0]["info"]["run_id"]
        # MLflow 3 opens an experiment in its GenAI view unless the link names the mode (as `rlstage ui` prints)
        shoot(f"{mlflow}/#/experiments/{exp['experiment_id']}/runs/{run_id}/model-metrics?workflowType=machine_learning", docs / "ui-mlflow.png")
    finally:
        ui.terminate()
        ui.wait(60)
        shutil.rmtree(work, ignore_errors=True)


def site_screenshots(out: Path) -> None:
    """The docs site as a reader sees it: the configuration reference and the algorithms page."""
    site = Path(tempfile.mkdtemp(prefix="rlstage-site-"))
    subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(site)], cwd=REPO, check=True)
    out.mkdir(parents=True, exist_ok=True)
    for page in ("reference/config", "reference/registries", "algorithms", "data"):
        shoot((site / page / "index.html").as_uri(), out / f"site-{page.replace('/', '-')}.png", size="1400,1800", wait_ms=3000)
    shutil.rmtree(site, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--site", type=Path, default=None, help="also photograph the built docs site into this folder")
    parser.add_argument("--no-ui", action="store_true", help="skip the run and the UIs (the docs site only)")
    args = parser.parse_args(argv)
    chromium()
    started = time.monotonic()
    if not args.no_ui:
        ui_screenshots(REPO / "docs")
    if args.site is not None:
        site_screenshots(args.site)
    print(f"done in {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
