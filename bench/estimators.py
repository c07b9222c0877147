"""Each estimator config from the same SFT start and budget; one JSON line per estimator.

    .venv/bin/python bench/estimators.py [--iterations 20] [--store /tmp/rlstage-bench] [names...]

Runs through the real pipeline (a local Prefect server, Ray, the store and MLflow).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NAMES = ["ppo_gae", "grpo", "dr_grpo", "rloo", "reinforce_plus_plus", "remax"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("names", nargs="*", default=NAMES)
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--store", default="/tmp/rlstage-bench")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from flows.cli import prefect_api
    from infra.env import apply_defaults

    apply_defaults()
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    with prefect_api():
        from flows.training import train
        from schemas.config import load_config

        for name in args.names:
            cfg = load_config(
                ROOT / "configs" / f"{name}.yaml",
                [f"store.root={args.store}", f"run_name=bench-{name}", f"trainer.iterations={args.iterations}"],
            )
            t0 = time.perf_counter()
            result = train(config=cfg)
            wall = time.perf_counter() - t0
            hist = result["history"]
            accs = [h["val/accuracy"] for h in hist if "val/accuracy" in h]
            last = hist[-1]
            print(
                json.dumps(
                    {
                        "estimator": name,
                        "iterations": args.iterations,
                        "accuracy_before": accs[0],
                        "accuracy_after": accs[-1],
                        "gain_points": round((accs[-1] - accs[0]) * 100, 1),
                        "wall_s": round(wall, 1),
                        "ppo_kl": last.get("actor/ppo_kl"),
                        "ref_kl": last.get("actor/ref_kl"),
                        "kl_loss": last.get("actor/kl_loss"),
                        "entropy": last.get("actor/entropy"),
                    }
                ),
                flush=True,
            )


if __name__ == "__main__":
    main()
