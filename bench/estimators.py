"""Each estimator config from the same SFT start and budget; one JSON line per run.

    .venv/bin/python bench/estimators.py [--iterations 20] [--store /tmp/rlstage-bench] [names...]

A run is a config of ``configs/`` plus a few overrides (``RUNS``): the estimator configs, then verl 0.9.1's
further estimators and losses, each one setting changed on ``grpo.yaml`` (or the tool-calling demo for the
multi-turn estimator). With no names, every run; ``--list`` prints them. Runs through the real pipeline (a
local Prefect server, Ray, the store and MLflow).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_OTB = ["actor.calculate_sum_pi_squared=true"]  # the old-log-prob pass returns sum pi^2 (verl's flag)
# name -> (config of configs/, overrides)
RUNS: dict[str, tuple[str, list[str]]] = {
    **{n: (n, []) for n in ("ppo_gae", "grpo", "dr_grpo", "rloo", "reinforce_plus_plus", "remax")},
    **{n: (n, []) for n in ("gspo", "sapo", "gmpo", "dapo", "rollout_corr", "lora")},
    "grpo_vectorized": ("grpo", ["algorithm.adv_estimator=grpo_vectorized"]),
    "rloo_vectorized": ("rloo", ["algorithm.adv_estimator=rloo_vectorized"]),
    "grpo_passk": ("grpo", ["algorithm.adv_estimator=grpo_passk"]),
    "gdpo": ("grpo", ["algorithm.adv_estimator=gdpo"]),
    "optimal_token_baseline": ("grpo", ["algorithm.adv_estimator=optimal_token_baseline", *_OTB]),
    "clip_cov": ("grpo", ["actor.policy_loss=clip_cov"]),
    "kl_cov": ("grpo", ["actor.policy_loss=kl_cov"]),
    "dppo_tv": ("grpo", ["actor.policy_loss=dppo_tv"]),
    "dppo_kl": ("grpo", ["actor.policy_loss=dppo_kl"]),
    "dro": ("grpo", ["actor.policy_loss=dro", "actor.dro_beta=0.1"]),
    "cispo": ("grpo", ["actor.policy_loss=cispo"]),
    "token_sum": ("grpo", ["actor.loss_agg_mode=token-sum"]),
    "bypass_reinforce": (
        "grpo", ["algorithm.rollout_correction.bypass_mode=true", "algorithm.rollout_correction.loss_type=reinforce"],
    ),  # fmt: skip
    "agent_grpo": ("agent_calc", []),
    "agent_tir_otb": ("agent_calc", ["algorithm.adv_estimator=tir_optimal_token_baseline", *_OTB]),
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("names", nargs="*", default=list(RUNS), choices=list(RUNS), metavar="name")
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--store", default="/tmp/rlstage-bench")
    parser.add_argument("--list", action="store_true", help="print each run's config and overrides, run nothing")
    args = parser.parse_args()
    if args.list:
        for name, (config, overrides) in RUNS.items():
            print(f"{name}: configs/{config}.yaml {' '.join(overrides)}")
        return
    sys.path.insert(0, str(ROOT))
    from rlstage.flows.cli import prefect_api
    from rlstage.infra.env import apply_defaults

    apply_defaults()
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    with prefect_api():
        from rlstage.flows.training import train
        from rlstage.schemas.config import load_config

        for name in args.names:
            config, overrides = RUNS[name]
            cfg = load_config(
                ROOT / "configs" / f"{config}.yaml",
                [*overrides, f"store.root={args.store}", f"run_name=bench-{name}", f"trainer.iterations={args.iterations}"],
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
                        "run": name,
                        "config": f"configs/{config}.yaml",
                        "overrides": overrides,
                        "iterations": args.iterations,
                        "accuracy_before": accs[0],
                        "accuracy_after": accs[-1],
                        "gain_points": round((accs[-1] - accs[0]) * 100, 1),
                        "wall_s": round(wall, 1),
                        # the first run of a kit trains its SFT start, inside its wall time
                        "trained_sft": any(e.endswith("sft") for e in result["executed"]),
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
