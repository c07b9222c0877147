"""The plain-torch train engine: recomputes log-probs and runs the PPO-family policy update.

A DeepSpeed engine implements the same methods (``compute_log_probs``, ``update``,
``state_dict`` / ``load_state_dict``) so stages never know which one they drive. The mini-batch loop,
micro-batch planning (fixed count or token budget, padded or packed) and the optimizer live in
``engines.batching.MiniBatchTrainer``, shared with the critic.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engines import algorithms as algos
from engines.batching import (
    MicroBatch,
    MiniBatchTrainer,
    lr_lambda,
    micro_weight,
    response_log_probs,
)

__all__ = ["TorchActor", "lr_lambda"]

# Policy losses that aggregate with a fixed mode whatever loss_agg_mode says (see their docstrings).
FIXED_PG_AGG = {"gspo": "seq-mean-token-mean"}


class TorchActor(MiniBatchTrainer):
    metric_prefix = "actor"

    @torch.no_grad()
    def compute_log_probs(
        self, prompt_ids: Sequence[Sequence[int]], response_ids: Sequence[Sequence[int]], temperature: float
    ) -> list[list[float]]:
        self.model.eval()
        out: list[list[float] | None] = [None] * len(prompt_ids)
        for ids, inputs in self._no_grad_chunks(prompt_ids, response_ids):
            logp, _ = response_log_probs(self.model, inputs, temperature)
            for row, i in enumerate(ids):
                out[i] = logp[row, : len(response_ids[i])].tolist()
        return out

    def update(self, batch: dict[str, list], temperature: float, seed: int) -> dict[str, float]:
        """PPO epochs over shuffled mini-batches; one optimizer step per mini-batch.

        ``batch`` holds per-sample lists: prompt_ids, response_ids, response_mask, old_log_probs,
        advantages and, with a KL loss, ref_log_probs.
        """
        loss_fn = algos.get_policy_loss(self.cfg.policy_loss)
        return self._train_epochs(batch, seed, lambda micro: self._micro_step(batch, micro, temperature, loss_fn))

    def _micro_step(self, batch, micro: MicroBatch, temperature: float, loss_fn) -> dict[str, float]:
        cfg = self.cfg
        fields = ["response_mask", "old_log_probs", "advantages"] + (["ref_log_probs"] if cfg.use_kl_loss else [])
        inputs, (mask, old, adv, *ref) = self._micro_inputs(batch, micro.idx, *fields)
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
        # Token-budget mode: each term becomes its share of the mini-batch's aggregate (exact accumulation).
        w_pg = w_agg = w_tok = 1.0
        if micro.norm is not None:
            w_pg = micro_weight(FIXED_PG_AGG.get(cfg.policy_loss, cfg.loss_agg_mode), mask, micro.norm)
            w_agg = micro_weight(cfg.loss_agg_mode, mask, micro.norm)
            w_tok = micro_weight("token-mean", mask, micro.norm)
            pg_loss, entropy_loss = pg_loss * w_pg, entropy_loss * w_agg
        loss = pg_loss - cfg.entropy_coeff * entropy_loss
        metrics = {"actor/pg_loss": float(pg_loss.detach()), "actor/entropy": float(entropy_loss.detach())}
        if cfg.use_kl_loss:
            kl = algos.agg_loss(algos.kl_penalty(logp, ref[0], cfg.kl_loss_type), mask, cfg.loss_agg_mode)
            if micro.norm is not None:
                kl = kl * w_agg
            loss = loss + cfg.kl_loss_coef * kl
            metrics["actor/kl_loss"] = float(kl.detach())
            metrics["actor/kl_coef"] = cfg.kl_loss_coef * w_tok
        (loss * micro.scale).backward()
        for k, v in pg_metrics.items():
            metrics[f"actor/{k}"] = float(v) * w_tok  # token means (w_tok is 1.0 in fixed-count mode)
        return metrics
