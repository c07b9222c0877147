"""rlstage against TRL's GRPOTrainer on the second demo's task: training seconds to a held-out accuracy target.

    .venv/bin/python bench/vs_trl_products.py [--seeds 0 1 2] [--target 0.47] [--max-seconds 1200]
                                              [--store /tmp/rlstage-vs-trl-products] [--only rlstage|trl] [overrides...]
    .venv/bin/python bench/vs_trl_products.py    # the race of issue #37 item 4: 3 seeds a side, target 0.47

The task is ``configs/reasoning-smollm2.yaml``: SmolLM2-135M-Instruct (``python -m rlstage.infra.models smollm2``)
on reasoning-gym's ``products``, greedy eval of the 200 held-out questions (base 0.32; the target 0.47 is base + 15
points). The overrides apply to rlstage's config, and TRL's settings are read off it (``Shape``), so both sides
change together.

The data is prepared once: ``rlstage data-prep`` commits the config's splits (run ``products-data``), and TRL reads
that artifact's train.parquet and test.parquet. Each rlstage seed's own data prep must commit the same bytes (the
manifests' sha256 are compared), so the splits are the same by construction and by check.

Per seed, back to back on this machine:
  rlstage: the config through the flow ``rlstage train`` runs (its Prefect server, Ray, vLLM rollout, store and
    MLflow), in a child process, with ``trainer.seed``, ``rollout.seed`` and ``data.shuffle_seed`` set to the seed
    (as ``bench/demo_seeds.py --real``) and ``trainer.eval_every=1`` and ``trainer.iterations=8`` (the config's 12 less those past every shipped seed's
    crossing; a seed that has not crossed by then is censored at its training seconds).
  TRL: bench/trl_products.py in the bench's TRL venv (its docstring: the settings and what differs), from the same
    model folder, with the same batch shape, lr, threads and reward function.
Both sides evaluate every 2 optimizer steps (one rlstage iteration, one TRL generation): accuracy moves fast here
(seed 0 went 0.32 -> 0.46 in rlstage's first iteration, 0.32 -> 0.425 after TRL's first optimizer step), so a
coarser grid would time the eval grid, not the learning.

Threads: both sides have this machine's cores (2) to themselves, one side at a time. rlstage's Ray gets them all
(``ray.num_cpus``), its trainer runs ``model.torch_threads`` = 2 torch threads and its vLLM engine binds both cores
(``rollout.vllm.cpu_threads_bind: auto``); TRL generates and trains in one process with ``torch.set_num_threads(2)``.
Every line says so (``threads``).

Time to target is measured as bench/vs_trl.py measures it: training seconds, evaluation left out on both sides
(for rlstage each iteration's whole wall less its eval stage, orchestration included; for TRL the wall from the
start of training less its evals); setup (services, model loading) counts on neither side, except that rlstage's
first iteration includes loading its trainer worker, as in vs_trl.py. A side that has not
reached the target within ``--max-seconds`` of training is censored ("not reached in X s"): TRL stops there,
rlstage's points past it do not count. A censored seed counts at its X, a lower bound, so a median over censored
seeds still bounds the ratio (``ratio_is``: exact, at most, at least).

Reward: TRL calls rlstage's own rule, found by ``data_source`` as the reward stage finds it (reasoning-gym is
installed in the TRL venv for it). The check that the values are equal: the driver scores a fixed set of answers
to held-out questions with the reward stage's own call (``score_rows``: edge cases, partial credit included) and
adds the greedy answers and scores that rlstage's eval stage stored for the seed; TRL's reward function, called
as TRL calls it, must give every one the same score before training starts.

A rerun into the same ``--store`` reuses each side's earlier runs of a seed (their JSON in its ``vs-trl-products``
folder): rlstage's always (the store refuses a second run of the name), TRL's when it reached the target within
``--max-seconds`` or trained at least that long; ``--only rlstage`` / ``--only trl`` runs one side (TRL's reward
check reads rlstage's stored answers of the seed, so rlstage's side of a seed runs first).

Prints one JSON line per side and seed (threads, settings, the curve as [[training seconds, accuracy, step], ...],
seconds to the target or censored), then a summary: each side's median and every seed, the ratio rlstage / TRL
(goal <= 0.5).
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from vs_trl import ROOT, first_at, overrides_tag, rlstage_cores, side, trl_python

CONFIG = "configs/reasoning-smollm2.yaml"
# before the user's: an eval every 2 optimizer steps, as TRL's; 8 iterations, since every seed of the shipped runs
# passed 0.47 by iteration 8 and points after the first at the target do not count
RACE_OVERRIDES = ["trainer.eval_every=1", "trainer.iterations=8"]
REWARD_TOLERANCE = 1e-6  # the eval stage stores its scores as float32


@dataclass(frozen=True)
class Shape:
    """What both sides share, read off rlstage's config (overrides included): TRL is configured from it."""

    prompts: int  # data.prompts_per_iteration: prompts whose groups one iteration trains on
    samples: int  # rollout.n
    max_new_tokens: int
    temperature: float
    lr: float
    weight_decay: float
    grad_clip: float
    mini_batch: int  # samples per optimizer step
    micro_batch: int  # samples per forward/backward
    eval_size: int  # the first held-out prompts, as rlstage's eval stage slices them
    eval_every_steps: int  # optimizer steps between evals (rlstage: trainer.eval_every iterations)
    threads: int  # model.torch_threads: TRL's torch threads

    @classmethod
    def of(cls, cfg) -> Shape:
        a, r = cfg.actor, cfg.rollout
        plain = a.ppo_epochs == 1 and a.optim.lr_schedule == "constant" and not a.optim.warmup_steps
        if not plain or r.top_p != 1 or r.top_k:
            sys.exit(
                "vs_trl_products: TRL's side mirrors one epoch, a constant lr, no warm-up, plain sampling"
            )
        steps = cfg.data.prompts_per_iteration * r.n // a.ppo_mini_batch_size
        return cls(
            cfg.data.prompts_per_iteration, r.n, r.max_new_tokens, r.temperature, a.optim.lr, a.optim.weight_decay,
            a.optim.grad_clip, a.ppo_mini_batch_size, a.micro_batch_size, cfg.data.eval_size, cfg.trainer.eval_every * steps,
            cfg.model.torch_threads,
        )  # fmt: skip


@dataclass(frozen=True)
class RewardCase:
    """An answer to a held-out question and rlstage's score of it: TRL's reward must give the same."""

    prompt_id: str
    response: str
    score: float
    # "edge" (scored by the reward stage's score_rows) or "eval-<iteration>" (stored by rlstage's eval stage)
    origin: str


@dataclass(frozen=True)
class Outcome:
    """Training seconds to the target, or, not reached, the seconds a side trained without reaching it (censored)."""

    seconds: float
    reached: bool


@dataclass
class SideRun:
    """One side's run of one seed, as its process writes it; the driver adds the time to target."""

    system: str
    seed: int
    threads: dict[str, int | str | None]  # the cores a side computes on and its torch (and vLLM) threads
    settings: dict
    # [[training seconds, held-out accuracy, step], ...]: the step is rlstage's iteration, TRL's optimizer step
    curve: list[list[float]]
    step_s: list[float]  # training seconds of each rlstage iteration / TRL optimizer step, evals left out
    eval_s: float
    setup_s: float
    extra: dict = field(default_factory=dict)

    def to_target(self, target: float, cap: float) -> Outcome:
        """The first evaluated point at or above ``target`` within ``cap`` training seconds, else censored there."""
        hit = first_at([p for p in self.curve if p[0] <= cap], target)
        return (
            Outcome(hit, True) if hit is not None else Outcome(round(min(cap, self.curve[-1][0]), 1), False)
        )


def covers(run: SideRun, target: float, cap: float) -> bool:
    """Whether an earlier run of a side answers this race: it reached the target within the cap, or it trained at
    least the cap without reaching it."""
    return run.to_target(target, cap).reached or run.curve[-1][0] >= cap


def median_bound(outcomes: list[Outcome]) -> tuple[float, bool]:
    """The median seconds to target, censored seeds counted at their seconds; exact when no censored seed sorts at
    or before the middle (every censored seed then sorts after it whatever its true time), else a lower bound."""
    ordered = sorted(outcomes, key=lambda o: o.seconds)
    exact = all(o.reached for o in ordered[: len(ordered) // 2 + 1])
    return statistics.median(o.seconds for o in ordered), exact


def rlstage_config(args: argparse.Namespace, model: str, seed: int):
    from rlstage.schemas.config import load_config

    race = [f"model.path={model}", f"store.root={args.store}", f"run_name={run_name(args, seed)}",
            f"trainer.seed={seed}", f"rollout.seed={seed}", f"data.shuffle_seed={seed}", *RACE_OVERRIDES]  # fmt: skip
    return load_config(ROOT / CONFIG, [*race, *args.overrides])


def run_name(args: argparse.Namespace, seed: int) -> str:
    return f"products-race{'-' + overrides_tag(args.overrides) if args.overrides else ''}-seed{seed}"


def run_rlstage(args: argparse.Namespace) -> None:
    """The ``--side rlstage`` child: one seed through the training flow, timed from its history as in vs_trl.py."""
    from rlstage.flows.cli import prefect_api
    from rlstage.infra.env import apply_defaults
    from rlstage.infra.store import ArtifactStore

    apply_defaults()
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    seed = args.seeds[0]
    cfg = rlstage_config(args, args.model, seed)
    if cfg.run_name in ArtifactStore(args.store).runs():  # its committed stages would be reused, not timed
        sys.exit(f"run {cfg.run_name} is already in {args.store}: pass another --store (or remove it)")
    t0 = time.perf_counter()
    with prefect_api():
        from rlstage.flows.training import train

        history = train(config=cfg)["history"]
    curve, spent, step_s = [], 0.0, []
    for h in history:
        train_s = h["wall_s"] - h.get("timing_s/eval", 0.0)
        spent += train_s
        step_s += [round(train_s, 2)] if h["iteration"] >= 1 else []
        if "val/accuracy" in h:
            curve.append([round(spent, 3), h["val/accuracy"], h["iteration"]])
    trained = [h for h in history if h["iteration"] >= 1]
    row = SideRun(
        system="rlstage",
        seed=seed,
        threads={"cores": rlstage_cores(cfg), "torch_threads": cfg.model.torch_threads,
                 "vllm_cpu_threads_bind": cfg.rollout.vllm.cpu_threads_bind},
        settings={
            "config": CONFIG, "overrides": [*RACE_OVERRIDES, *args.overrides], "rollout": cfg.rollout.engine,
            "prompts_per_iteration": cfg.data.prompts_per_iteration, "gen_batch_size": cfg.data.gen_batch_size,
            "dynamic_sampling_max_rounds": cfg.algorithm.filter_groups.max_num_gen_batches if cfg.algorithm.filter_groups.enable else 0,
            "eval_every_iterations": cfg.trainer.eval_every, "iterations": cfg.trainer.iterations, "shape": asdict(Shape.of(cfg)),
        },
        curve=curve,
        step_s=step_s,
        eval_s=round(sum(h.get("timing_s/eval", 0.0) for h in history), 1),
        setup_s=round(time.perf_counter() - t0 - sum(h["wall_s"] for h in history), 1),
        extra={
            "eval_stage_s": [round(h["timing_s/eval"], 1) for h in history if "timing_s/eval" in h],
            "median_stage_s": {k.removeprefix("timing_s/"): round(statistics.median(h.get(k, 0.0) for h in trained), 2) for k in
                               ("timing_s/rollout", "timing_s/filter_groups", "timing_s/advantage", "timing_s/update")},
        },
    )  # fmt: skip
    Path(args.out).write_text(json.dumps(asdict(row)))


@dataclass(frozen=True)
class Prepared:
    """The splits both sides read: one committed data prep artifact."""

    train: str
    test: str
    sha256: dict[str, str]


def split_digest(m) -> dict[str, str]:
    """The sha256 of the train and test splits a data_prep manifest committed."""
    return {name: m.files[name].sha256 for name in ("train.parquet", "test.parquet")}


def prepare_data(args: argparse.Namespace, model: str) -> Prepared:
    """rlstage's own data prep of the config, committed once (a rerun reuses it; another config is refused)."""
    from rlstage.infra.store import ArtifactStore

    run = f"products-data{'-' + overrides_tag(args.overrides) if args.overrides else ''}"
    cmd = [ROOT / ".venv" / "bin" / "rlstage", "data-prep", "-c", CONFIG, f"model.path={model}", f"run_name={run}",
           f"store.root={args.store}", *args.overrides]  # fmt: skip
    env = {**os.environ, "PREFECT_LOGGING_LEVEL": "WARNING"}
    subprocess.run([str(c) for c in cmd], cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL)
    store = ArtifactStore(args.store)
    m = store.manifest(run, None, "data_prep")
    return Prepared(store.uri(m, "train.parquet"), store.uri(m, "test.parquet"), split_digest(m))


def edge_cases(cfg, test_path: str, questions: int = 20) -> list[RewardCase]:
    """Answers around the truth of the first held-out questions, scored by the reward stage's own call."""
    import pyarrow.parquet as pq

    from rlstage.tasks.stages import score_rows

    forms = ["{t}", "{q} = {t}", "{t:,}", "{t}.00", "+0{t}", "{t}0", "{u}", "The answer is {t}, not {u}.", "{t} {u}",
             "twelve", "", "{q} = {u}<|im_end|>"]  # fmt: skip
    rows = pq.read_table(test_path).slice(0, questions).to_pylist()
    cases = []
    for r in rows:
        t = int(r["ground_truth"])
        q = json.loads(r["extra_info"])["entry"]["metadata"]["expression"]
        cases += [(r, form.format(t=t, u=t + 1, q=q)) for form in forms]
    scored = score_rows(cfg, [{**r, "response_text": text} for r, text in cases])
    return [
        RewardCase(r["prompt_id"], text, s.score, "edge") for (r, text), s in zip(cases, scored, strict=True)
    ]


def eval_cases(store, run: str) -> list[RewardCase]:
    """The greedy answers rlstage's eval stage stored for a run, with the scores it gave them."""
    cases = []
    for it in store.iterations(run):
        m = store.manifest(run, it, "eval")
        if m is not None:
            t = store.read_table(m, "eval.parquet").to_pylist()
            cases += [
                RewardCase(r["prompt_id"], r["response_text"], r["score"], f"eval-{it}")
                for r in t
                if r["sample_index"] == -1
            ]
    return cases


def trl_python_with_tasks() -> Path:
    """The bench's TRL venv, plus reasoning-gym at this venv's version: TRL's reward is rlstage's own function."""
    py = trl_python()
    version = md.version("reasoning-gym")
    probe = f"import importlib.metadata as m; assert m.version('reasoning-gym') == '{version}'"
    if subprocess.run([py, "-c", probe], capture_output=True).returncode:
        print(
            f"installing reasoning-gym=={version} into the TRL venv (once) ...", file=sys.stderr, flush=True
        )
        subprocess.run([py, "-m", "pip", "install", "-q", f"reasoning-gym=={version}"], check=True)
    return py


def ratio(rl: tuple[float, bool], trl: tuple[float, bool], goal: float = 0.5) -> dict:
    """rlstage / TRL of the medians (each: seconds, exact). A lower bound on TRL's median bounds the ratio from
    above, one on rlstage's from below; ``goal_met`` is null where the bound leaves it open."""
    value = round(rl[0] / trl[0], 3)
    kind = {(True, True): "exact", (True, False): "at most", (False, True): "at least"}.get(
        (rl[1], trl[1]), "unknown"
    )
    met = {
        "exact": value <= goal,
        "at most": value <= goal or None,
        "at least": None if value <= goal else False,
    }.get(kind)
    return {
        "ratio_rlstage_over_trl": None if kind == "unknown" else value,
        "ratio_is": kind,
        "goal": goal,
        "goal_met": met,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "overrides", nargs="*", help="dotted overrides on top of the config (TRL's side follows them)"
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument(
        "--target", type=float, default=0.47, help="held-out accuracy (base 0.32 + 15 points)"
    )
    parser.add_argument(
        "--max-seconds",
        type=float,
        default=1200.0,
        help="training seconds after which a side is censored (at >= 2x rlstage's time it still decides the 0.5 goal)",
    )
    parser.add_argument("--store", default="/tmp/rlstage-vs-trl-products")
    parser.add_argument(
        "--only", choices=["rlstage", "trl"], help="run one side; the other's earlier runs in --store are reused"
    )
    # the child that runs one rlstage seed
    parser.add_argument("--side", choices=["rlstage"], help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        run_rlstage(args)
        return
    from rlstage.infra.models import fetch_model
    from rlstage.infra.store import ArtifactStore

    model = str(fetch_model("smollm2"))
    py = trl_python_with_tasks()
    work = Path(args.store) / "vs-trl-products"
    work.mkdir(parents=True, exist_ok=True)
    data = prepare_data(args, model)
    cfg = rlstage_config(args, model, args.seeds[0])
    shape = Shape.of(cfg)
    edge = edge_cases(cfg, data.test)
    store = ArtifactStore(args.store)
    rows: list[dict] = []
    outcomes: dict[str, list[Outcome]] = {"rlstage": [], "trl": []}
    for seed in args.seeds:
        got: dict[str, SideRun] = {}
        out = work / f"rlstage-seed{seed}.json"
        if out.exists():  # its run is in the store, which refuses a second one: reused
            got["rlstage"] = SideRun(**json.loads(out.read_text()))
        elif args.only != "trl":
            print(f"seed {seed}: rlstage ...", file=sys.stderr, flush=True)
            cmd = [sys.executable, __file__, "--side", "rlstage", "--seeds", seed, "--store", args.store, "--model", model]  # fmt: skip
            got["rlstage"] = SideRun(**side([*cmd, "--out", out, *args.overrides], out))
        ran = run_name(args, seed) in store.runs()
        if ran and split_digest(store.manifest(run_name(args, seed), None, "data_prep")) != data.sha256:
            sys.exit(
                f"seed {seed}: rlstage's data prep committed other splits than {data.train} / {data.test}"
            )
        out = work / f"trl-seed{seed}.json"
        earlier = SideRun(**json.loads(out.read_text())) if out.exists() else None
        if earlier is not None and covers(earlier, args.target, args.max_seconds):
            got["trl"] = earlier
        elif args.only != "rlstage":
            if not ran:
                sys.exit(f"seed {seed}: TRL's reward check reads rlstage's stored answers: run rlstage's side first")
            check = work / f"reward-check-seed{seed}.jsonl"
            check.write_text(
                "".join(json.dumps(asdict(c)) + "\n" for c in [*edge, *eval_cases(store, run_name(args, seed))])
            )
            print(f"seed {seed}: TRL ...", file=sys.stderr, flush=True)
            got["trl"] = SideRun(**side(
                [py, ROOT / "bench" / "trl_products.py", "--model", model, "--train", data.train, "--test", data.test,
                 "--reward-check", check, "--shape", json.dumps(asdict(shape)), "--seed", seed, "--target", args.target,
                 "--max-seconds", args.max_seconds, "--out", out],
                out,
            ))  # fmt: skip
        for r in got.values():
            outcomes[r.system].append(r.to_target(args.target, args.max_seconds))
            rows.append(asdict(r) | {"target": args.target, "to_target": asdict(outcomes[r.system][-1])})
            print(json.dumps(rows[-1]), flush=True)
    summary: dict = {"target": args.target, "max_seconds": args.max_seconds, "seeds": args.seeds,
                     "threads": {r["system"]: r["threads"] for r in rows}}  # fmt: skip
    medians = {system: median_bound(o) for system, o in outcomes.items() if o}
    for system, o in outcomes.items():
        if not o:
            continue
        summary[system] = {
            "median_s": medians[system][0],
            "median_is": "exact" if medians[system][1] else "lower bound",
            "per_seed": [x.seconds if x.reached else f"not reached in {x.seconds} s" for x in o],
            "final": [r["curve"][-1][1] for r in rows if r["system"] == system],
        }
    both = len(outcomes["rlstage"]) == len(outcomes["trl"]) == len(args.seeds)
    print(json.dumps(summary | (ratio(medians["rlstage"], medians["trl"]) if both else {})), flush=True)


if __name__ == "__main__":
    main()
