"""The reward-model role: a Ray actor that loads a sequence-classification model from its path and scores.

Weights never cross Ray: the worker reads ``reward_model.model.path`` itself; stages send texts and get
floats back. A flow opens it beside the policy group and releases it at the end; a stage run without
the flow (a replay) creates it on first use under the same name.
"""

from __future__ import annotations

import hashlib

import ray
import torch

from rlstage.engines.rewards.reward_model import load_reward_model, score_texts
from rlstage.infra.ray_runtime import RAY_NAMESPACE
from rlstage.schemas.config import RunConfig
from rlstage.schemas.stages import ConfigView, whole_config


class RewardModelWorker:
    def __init__(self, path: str, micro_batch_size: int, token_budget: int | None) -> None:
        torch.set_num_threads(1)  # stage tasks and the policy worker share the CPUs
        self.model, self.tokenizer = load_reward_model(path)
        self.micro_batch_size, self.token_budget = micro_batch_size, token_budget

    def score(self, prompts: list[str], responses: list[str]) -> list[float]:
        return score_texts(
            self.model, self.tokenizer, prompts, responses, micro_batch_size=self.micro_batch_size, token_budget=self.token_budget
        )


def worker_name(cfg: RunConfig) -> str:
    # The path is in the name: a run whose RM changed never scores with the old one.
    digest = hashlib.sha256(str(cfg.reward_model.model.path).encode()).hexdigest()[:8]
    return f"reward-model-{cfg.run_name}-{digest}"


def open_reward_model(cfg: RunConfig | ConfigView):
    """The run's reward-model actor, created on first use with the resources of ``reward_model``."""
    cfg = whole_config(cfg)
    rm = cfg.reward_model
    return (
        ray.remote(RewardModelWorker)
        .options(
            name=worker_name(cfg), namespace=RAY_NAMESPACE, get_if_exists=True, num_cpus=rm.num_cpus, num_gpus=rm.num_gpus
        )
        .remote(rm.model.path, rm.micro_batch_size_per_gpu, rm.forward_max_token_len_per_gpu if rm.use_dynamic_bsz else None)
    )


def release_reward_model(cfg: RunConfig) -> None:
    try:
        ray.kill(ray.get_actor(worker_name(cfg), namespace=RAY_NAMESPACE))
    except ValueError:  # never started (no reward model, or no stage needed it)
        pass
