"""The plain-torch train engine: recomputes log-probs and runs the PPO-family policy update.

A DeepSpeed engine implements the same methods (``compute_log_probs``, ``update``,
``state_dict`` / ``load_state_dict``) so stages never know which one they drive.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence

import torch

from engines import algorithms as algos
from engines.batching import build_inputs, pad_right, response_log_probs
from schemas.config import ActorConfig, OptimConfig


def lr_lambda(optim: OptimConfig, total_steps: int):
    """Linear warm-up, then constant, cosine or linear decay down to ``min_lr_ratio``."""

    def fn(step: int) -> float:
        if step < optim.warmup_steps:
            return (step + 1) / optim.warmup_steps
        if optim.lr_schedule == "constant":
            return 1.0
        span = max(1, total_steps - optim.warmup_steps)
        progress = min(1.0, (step - optim.warmup_steps) / span)
        if optim.lr_schedule == "cosine":
            decay = 0.5 * (1 + math.cos(math.pi * progress))
        else:
            decay = 1 - progress
        return optim.min_lr_ratio + (1 - optim.min_lr_ratio) * decay

    return fn


class TorchActor:
    def __init__(self, model: torch.nn.Module, cfg: ActorConfig, pad_id: int, total_steps: int) -> None:
        self.model = model
        self.cfg = cfg
        self.pad_id = pad_id
        o = cfg.optim
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=o.betas, weight_decay=o.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(o, o.total_steps or total_steps))

    @torch.no_grad()
    def compute_log_probs(
        self, prompt_ids: Sequence[Sequence[int]], response_ids: Sequence[Sequence[int]], temperature: float
    ) -> list[list[float]]:
        self.model.eval()
        out: list[list[float]] = []
        mb = self.cfg.micro_batch_size * 4  # no activations are kept, so larger chunks fit
        for s in range(0, len(prompt_ids), mb):
            inputs = build_inputs(prompt_ids[s : s + mb], response_ids[s : s + mb], self.pad_id)
            logp, _ = response_log_probs(self.model, inputs, temperature)
            for row, r in enumerate(response_ids[s : s + mb]):
                out.append(logp[row, : len(r)].tolist())
        return out

    def update(self, batch: dict[str, list], temperature: float, seed: int) -> dict[str, float]:
        """PPO epochs over shuffled mini-batches; one optimizer step per mini-batch.

        ``batch`` holds per-sample lists: prompt_ids, response_ids, response_mask, old_log_probs,
        advantages and, with a KL loss, ref_log_probs.
        """
        cfg = self.cfg
        n = len(batch["prompt_ids"])
        loss_fn = algos.get_policy_loss(cfg.policy_loss)
        gen = torch.Generator().manual_seed(seed)
        sums: dict[str, list[float]] = defaultdict(list)
        self.model.train()
        for _epoch in range(cfg.ppo_epochs):
            order = torch.randperm(n, generator=gen).tolist() if cfg.shuffle else list(range(n))
            for m in range(0, n, cfg.ppo_mini_batch_size):
                mini = order[m : m + cfg.ppo_mini_batch_size]
                self.optimizer.zero_grad(set_to_none=True)
                for u in range(0, len(mini), cfg.micro_batch_size):
                    idx = mini[u : u + cfg.micro_batch_size]
                    metrics = self._micro_step(batch, idx, temperature, loss_fn, len(idx) / len(mini))
                    for k, v in metrics.items():
                        sums[k].append(v)
                grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.optim.grad_clip)
                if torch.isfinite(grad_norm):
                    self.optimizer.step()
                sums["actor/grad_norm"].append(float(grad_norm))
                sums["actor/lr"].append(self.scheduler.get_last_lr()[0])
                self.scheduler.step()
        self.model.eval()
        return {k: float(sum(v) / len(v)) for k, v in sums.items()}

    def _micro_step(self, batch, idx: list[int], temperature: float, loss_fn, scale: float) -> dict[str, float]:
        cfg = self.cfg
        resp = [batch["response_ids"][i] for i in idx]
        inputs = build_inputs([batch["prompt_ids"][i] for i in idx], resp, self.pad_id)
        R = inputs["response_width"]
        mask = pad_right([batch["response_mask"][i] for i in idx], 0, torch.float32, R)
        old = pad_right([batch["old_log_probs"][i] for i in idx], 0.0, torch.float32, R)
        adv = pad_right([batch["advantages"][i] for i in idx], 0.0, torch.float32, R)
        logp, entropy = response_log_probs(self.model, inputs, temperature, with_entropy=True)
        pg_loss, pg_metrics = loss_fn(
            old,
            logp,
            adv,
            mask,
            cfg.loss_agg_mode,
            clip_ratio_low=cfg.clip_ratio_low,
            clip_ratio_high=cfg.clip_ratio_high,
            clip_ratio_c=cfg.clip_ratio_c,
        )
        entropy_loss = algos.agg_loss(entropy, mask, cfg.loss_agg_mode)
        loss = pg_loss - cfg.entropy_coeff * entropy_loss
        metrics = {"actor/pg_loss": float(pg_loss.detach()), "actor/entropy": float(entropy_loss.detach())}
        if cfg.use_kl_loss:
            ref = pad_right([batch["ref_log_probs"][i] for i in idx], 0.0, torch.float32, R)
            kl = algos.agg_loss(algos.kl_penalty(logp, ref, cfg.kl_loss_type), mask, cfg.loss_agg_mode)
            loss = loss + cfg.kl_loss_coef * kl
            metrics["actor/kl_loss"] = float(kl.detach())
            metrics["actor/kl_coef"] = cfg.kl_loss_coef
        (loss * scale).backward()
        for k, v in pg_metrics.items():
            metrics[f"actor/{k}"] = float(v)
        return metrics

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
