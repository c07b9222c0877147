"""Each estimator config from the same SFT start, over seeds; one JSON line per run and one summary per name.

    .venv/bin/python bench/estimators.py [--seeds 0 1 2] [--iterations N] [--store /tmp/rlstage-bench] [names...]

A run is a config of ``configs/`` plus a few overrides (``RUNS``): the shipped algorithm configs, then verl
0.9.1's further estimators and losses, each one setting changed on ``grpo.yaml`` (or the tool-calling demo for
the multi-turn estimator). A seed sets ``trainer.seed`` and ``sft.seed``, so each seed has its own SFT start
(trained once, shared by that seed's runs); ``rm_tiny`` first builds its reward model from that start. Without
``--iterations`` each config runs its own ``trainer.iterations``. With no names, every run; ``--list`` prints
them. Runs through the real pipeline (a local Prefect server, Ray, the store and MLflow).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
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
    "rm_tiny": ("rm_tiny", []),  # its reward model is built first (rlstage reward-model), one per seed
    "agent_grpo": ("agent_calc", []),
    "agent_tir_otb": ("agent_calc", ["algorithm.adv_estimator=tir_optimal_token_baseline", *_OTB]),
}

# the shipped algorithm configs, each run as shipped (#41: each >= +10 points, median of 3 seeds)
SHIPPED = ["grpo", "rloo", "dr_grpo", "gspo", "gmpo", "sapo", "dapo", "reinforce_plus_plus", "remax", "ppo_gae"]
SHIPPED += ["rollout_corr", "lora", "rm_tiny", "agent_grpo"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("names", nargs="*", metavar="name", help=f"runs (--list), or 'shipped': {' '.join(SHIPPED)}")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--iterations", type=int, default=None, help="default: each config's own trainer.iterations")
    parser.add_argument("--store", default="/tmp/rlstage-bench")
    parser.add_argument("--list", action="store_true", help="print each run's config and overrides, run nothing")
    parser.add_argument("--table", metavar="JSONL", help="print the docs' table of a file of this bench's lines, run nothing")
    args = parser.parse_args()
    if args.table:
        print(table(Path(args.table).read_text().splitlines()))
        return
    if args.list:
        for name, (config, overrides) in RUNS.items():
            print(f"{name}: configs/{config}.yaml {' '.join(overrides)}")
        return
    names = [n for x in args.names or list(RUNS) for n in (SHIPPED if x == "shipped" else [x])]
    if unknown := [n for n in names if n not in RUNS]:
        parser.error(f"unknown run {unknown[0]!r}: --list prints the runs")
    sys.path.insert(0, str(ROOT))
    from rlstage.flows.cli import prefect_api
    from rlstage.infra.env import apply_defaults

    apply_defaults()
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    gains: dict[str, list[float]] = {}
    with prefect_api():
        for seed in args.seeds:  # seeds outermost: each seed's SFT start is trained once, then shared
            for name in names:
                line = run_one(name, seed, args)
                gains.setdefault(name, []).append(line["gain_points"])
                print(json.dumps(line), flush=True)
    for name, g in gains.items():
        summary = {"median": statistics.median(g), "min": min(g), "max": max(g), "at_least_10": statistics.median(g) >= 10}
        print(json.dumps({"summary": name, "seeds": args.seeds, "gain_points": g, **summary}), flush=True)


def table(lines: list[str]) -> str:
    """Markdown: one row per run, every seed's before -> after, the median gain and its range."""
    runs: dict[str, list[dict]] = {}
    for line in lines:
        rec = json.loads(line) if line.startswith("{") else {}
        if "run" in rec:
            runs.setdefault(rec["run"], []).append(rec)
    out = ["| run | iterations | held-out before → after, each seed | gain (points), each seed | median gain | range |"]
    out.append("|---|---:|---|---|---:|---|")
    for name, recs in runs.items():
        recs.sort(key=lambda r: r["seed"])
        gains = [r["gain_points"] for r in recs]
        accs = " / ".join(f"{r['accuracy_before']:.3f} → {r['accuracy_after']:.3f}" for r in recs)
        out.append(
            f"| `{name}` | {recs[0]['iterations']} | {accs} | {' / '.join(f'{g:+.1f}' for g in gains)} "
            f"| **{statistics.median(gains):+.1f}** | {min(gains):+.1f} to {max(gains):+.1f} |"
        )
    return "\n".join(out)


def run_one(name: str, seed: int, args: argparse.Namespace) -> dict:
    from rlstage.flows.training import train
    from rlstage.schemas.config import load_config

    config, changed = RUNS[name]
    overrides = [*changed, f"store.root={args.store}", f"run_name=bench-{name}-s{seed}"]
    overrides += [f"trainer.seed={seed}", f"sft.seed={seed}"]
    if args.iterations is not None:
        overrides.append(f"trainer.iterations={args.iterations}")
    t0 = time.perf_counter()
    if name == "rm_tiny":
        overrides.append(f"reward_model.model.path={build_reward_model(config, overrides, seed, args.store)}")
    cfg = load_config(ROOT / "configs" / f"{config}.yaml", overrides)
    result = train(config=cfg)
    wall = time.perf_counter() - t0
    hist = result["history"]
    accs = [h["val/accuracy"] for h in hist if "val/accuracy" in h]
    last = hist[-1]
    return {
        "run": name,
        "seed": seed,
        "config": f"configs/{config}.yaml",
        "overrides": changed,
        "iterations": cfg.trainer.iterations,
        "accuracy_before": accs[0],
        "accuracy_best": max(accs),
        "accuracy_after": accs[-1],
        "gain_points": round((accs[-1] - accs[0]) * 100, 1),
        "wall_s": round(wall, 1),
        # the first run of a seed trains its SFT start (and rm_tiny its reward model), inside its wall time
        "trained_sft": any(e.endswith("sft") for e in result["executed"]),
        "ppo_kl": last.get("actor/ppo_kl"),
        "ref_kl": last.get("actor/ref_kl"),
        "kl_loss": last.get("actor/kl_loss"),
        "entropy": last.get("actor/entropy"),
    }


def build_reward_model(config: str, overrides: list[str], seed: int, store: str) -> str:
    """The seed's reward model, as ``rlstage reward-model -c configs/rm_tiny.yaml`` builds it (reused if built)."""
    from rlstage.flows.reward_kit import RMKitSettings, build_kit_reward_model
    from rlstage.schemas.config import load_config

    out = Path(store) / f"rm-tiny-s{seed}"
    if not (out / "config.json").is_file():
        cfg = load_config(ROOT / "configs" / f"{config}.yaml", [*overrides, "reward_model.enable=false"])
        print(json.dumps({"reward_model": build_kit_reward_model(out=str(out), settings=RMKitSettings(seed=seed), config=cfg)}), flush=True)
    return str(out)


if __name__ == "__main__":
    main()
