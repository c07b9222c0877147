"""``rlstage reward-model``: a tiny reward model for the kit's task, trained from the kit's SFT policy.

The RM is the SFT model's body with a one-logit head, fitted to the SFT policy's own samples of the train
split labelled by the task's rule, plus each prompt's true answer. What RL then shows it is close to what
it learnt on; trained on true answers against one-digit near misses only, a policy exploits it.
Held-out metrics come from samples of the test split that the RM never saw.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from prefect import flow

from rlstage.engines.data import datasets
from rlstage.engines.models.tinykit import save_model_dir
from rlstage.engines.rewards.reward_model import (
    Labelled,
    answer_swaps,
    classification_accuracy,
    labelled_pairs,
    policy_samples,
    ranking_accuracy,
    reward_model_from_policy,
    score_texts,
    train_reward_model,
)
from rlstage.flows.training import resolve_config
from rlstage.infra.env import apply_defaults
from rlstage.schemas.config import ConfigError, RunConfig
from rlstage.tasks import stages
from rlstage.tasks.kit import sft_warm_start
from rlstage.tasks.runtime import policy_ref_from, store_for
from rlstage.workers.policy import fetch_model


@dataclass(frozen=True)
class RMKitSettings:
    prompts: int = 4000  # train prompts sampled (the first ones of the kit's train split)
    samples_per_prompt: int = 8
    steps: int = 2000
    batch_size: int = 64
    lr: float = 3e-4
    seed: int = 0


def check_kit_reward_model(cfg: RunConfig, s: RMKitSettings, out: Path) -> None:
    """One line naming what makes this build impossible, before anything starts."""
    if cfg.model.path is not None or not datasets.uses_kit(cfg.data.source):
        raise ConfigError("config error: rlstage reward-model trains on the kit's synthetic task (no model.path, data.source: synthetic)")
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"config error: --out {out} exists and is not empty")
    for name in ("prompts", "samples_per_prompt", "steps", "batch_size"):
        if getattr(s, name) < 1:
            raise ConfigError(f"config error: --{name.replace('_', '-')}: must be >= 1, got {getattr(s, name)}")
    if not s.lr > 0:
        raise ConfigError(f"config error: --lr: must be > 0, got {s.lr}")


@flow(name="rlstage-reward-model-kit")
def build_kit_reward_model(
    out: str,
    settings: RMKitSettings = RMKitSettings(),  # noqa: B008 (frozen)
    config: RunConfig | None = None,
    config_path: str | None = None,
    overrides: list[str] | None = None,
) -> dict:
    """Train the kit's SFT (or reuse it), then the reward model on its samples; write it to ``out``."""
    apply_defaults()
    cfg = resolve_config(config, config_path, overrides)
    s, out_dir = settings, Path(out)
    check_kit_reward_model(cfg, s, out_dir)
    torch.set_num_threads(cfg.model.torch_threads)
    t0 = time.perf_counter()
    store = store_for(cfg)
    sft = stages.result_of(sft_warm_start(cfg))  # committed under the kit's run: reused by the RL run after
    k = cfg.kit
    train, test = datasets.make_task_splits(k.task, k.digits, k.train_size, k.test_size, k.seed)
    source = train.column("data_source")[0].as_py()
    train = train.slice(0, s.prompts)
    with tempfile.TemporaryDirectory(prefix="rlstage-rm-") as tmp:
        sft_dir = fetch_model(store, policy_ref_from(sft.manifest), Path(tmp) / "sft")
        rm, tok = reward_model_from_policy(str(sft_dir))
        from transformers import AutoModelForCausalLM

        policy = AutoModelForCausalLM.from_pretrained(sft_dir).eval()
    max_new = cfg.rollout.max_new_tokens

    def sample(table, seed: int) -> Labelled:
        prompts, answers = table.column("prompt").to_pylist(), table.column("ground_truth").to_pylist()
        return policy_samples(policy, tok, prompts, answers, source, n=s.samples_per_prompt, max_new_tokens=max_new, seed=seed)

    fit = sample(train, s.seed)
    swaps = answer_swaps(train.column("prompt").to_pylist(), train.column("ground_truth").to_pylist(), s.samples_per_prompt, s.seed)
    prompts, responses, labels = fit.prompts + swaps[0], fit.responses + swaps[1], fit.labels + swaps[2]
    torch.manual_seed(s.seed)
    losses = train_reward_model(rm, tok, prompts, responses, labels, steps=s.steps, batch_size=s.batch_size, lr=s.lr, seed=s.seed)
    held = sample(test, s.seed + 1)
    scores = score_texts(rm, tok, held.prompts, held.responses, micro_batch_size=512)
    near = labelled_pairs(test.column("prompt").to_pylist(), test.column("ground_truth").to_pylist(), s.seed)
    save_model_dir(rm, tok, out_dir)
    return {
        "out": str(out_dir),
        "sft": sft.manifest.artifact_id,
        "sft_accuracy": sft.metrics["sft/test_accuracy"],
        "train_samples": len(labels),
        "train_positive_share": sum(labels) / len(labels),
        "loss_first": sum(losses[:20]) / min(20, len(losses)),
        "loss_last": sum(losses[-20:]) / min(20, len(losses)),
        "heldout_accuracy": classification_accuracy(scores, held.labels),
        "heldout_ranking_accuracy": ranking_accuracy(scores, held.labels, held.groups),
        "heldout_positive_share": sum(held.labels) / len(held.labels),
        "heldout_near_miss_accuracy": classification_accuracy(score_texts(rm, tok, near[0], near[1], micro_batch_size=512), near[2]),
        "seconds": time.perf_counter() - t0,
    }
