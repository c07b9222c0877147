"""The plain-torch train engine: recomputes log-probs and runs the PPO-family policy update.

A DeepSpeed engine implements the same methods (``compute_log_probs``, ``update``,
``state_dict`` / ``load_state_dict``) so stages never know which one they drive. The mini-batch loop,
micro-batch planning (fixed count or token budget, padded or packed) and the optimizer live in
``engines.training.batching.MiniBatchTrainer``, shared with the critic.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rlstage.engines import algorithms as algos
from rlstage.engines.training.batching import MicroBatch, MiniBatchTrainer, lr_lambda, metric_weight
from rlstage.engines.training.forward import pad_right, response_log_probs

__all__ = ["DataParallelTorchActor", "TorchActor", "lr_lambda"]


class TorchActor(MiniBatchTrainer):
    metric_prefix = "actor"

    @property
    def _shared(self) -> bool:
        return self.cfg.share_prompts

    @property
    def _whole_groups(self) -> bool:
        return self.cfg.group_mini_batches

    @torch.no_grad()
    def compute_log_probs(
        self, prompt_ids: Sequence[Sequence[int]], response_ids: Sequence[Sequence[int]], temperature: float
    ) -> list[list[float]]:
        return self._no_grad_pass(prompt_ids, response_ids, temperature, False)[0]

    @torch.no_grad()
    def compute_log_probs_and_sum_pi_squared(
        self, prompt_ids: Sequence[Sequence[int]], response_ids: Sequence[Sequence[int]], temperature: float
    ) -> tuple[list[list[float]], list[list[float]]]:
        """Log-probs and, per token, the sum over the vocabulary of pi^2 (verl's ``calculate_sum_pi_squared``),
        from one forward."""
        return self._no_grad_pass(prompt_ids, response_ids, temperature, True)

    def _no_grad_pass(self, prompt_ids, response_ids, temperature: float, sum_pi_squared: bool) -> tuple[list, list]:
        self.model.eval()
        logps: list = [None] * len(prompt_ids)
        sq: list = [None] * len(prompt_ids)
        for ids, inputs in self._no_grad_chunks(prompt_ids, response_ids):
            logp, s2 = response_log_probs(
                self.model, inputs, temperature, with_sum_pi_squared=sum_pi_squared, chunk_tokens=self.cfg.logits_chunk_tokens
            )
            for row, i in enumerate(ids):
                logps[i] = logp[row, : len(response_ids[i])].tolist()
                if s2 is not None:
                    sq[i] = s2[row, : len(response_ids[i])].tolist()
        return logps, sq

    def update(self, batch: dict[str, list], temperature: float, seed: int) -> dict[str, float]:
        """PPO epochs over shuffled mini-batches; one optimizer step per mini-batch.

        ``batch`` holds per-sample lists: prompt_ids, response_ids, response_mask, old_log_probs,
        advantages, with a KL loss ref_log_probs, and with rollout correction rollout_log_probs.
        Rollout correction (``cfg.rollout_correction``): in bypass mode the rollout's log-probs are the old
        policy and the loss is ``bypass_mode``; otherwise (decoupled) the importance weights of old vs
        rollout log-probs are computed once over the whole batch, as verl's driver does, and multiply the
        policy loss in every epoch; their ``rollout_corr/...`` metrics are returned with the others. (On a
        data-parallel rank holding a shard, the batch normalisation is over the shard: verl all-reduces it.)
        """
        rc = self.cfg.rollout_correction
        name = "bypass_mode" if rc.bypass_mode else self.cfg.policy_loss.name
        loss_fn = algos.get_policy_loss(name)
        # the loss's own settings, typed by its registered model (bypass mode takes vanilla's, which it replaces)
        settings = algos.policy_loss_settings(self.cfg.policy_loss)
        extra: dict = {} if settings is None else settings.model_dump()
        corr: dict[str, float] = {}
        if rc.bypass_mode:
            batch = {**batch, "old_log_probs": batch["rollout_log_probs"]}
            extra.update({k: getattr(rc, k) for k in ("loss_type", "rollout_is", "rollout_is_threshold", "rollout_is_batch_normalize")})
        elif rc.rollout_is is not None:
            batch, corr = self._with_is_weights(batch)
        # clip_cov picks tokens at random: seeded per update so a replay draws the same ones.
        extra["generator"] = torch.Generator().manual_seed(seed)
        step = lambda micro: self._micro_step(batch, micro, temperature, loss_fn, extra)  # noqa: E731
        return {**self._train_epochs(batch, seed, step), **corr}

    def _with_is_weights(self, batch: dict[str, list]) -> tuple[dict[str, list], dict[str, float]]:
        rc = self.cfg.rollout_correction
        width = max((len(r) for r in batch["response_ids"]), default=0)
        old, roll, mask = (pad_right(batch[k], 0.0, torch.float32, width) for k in ("old_log_probs", "rollout_log_probs", "response_mask"))
        weights, corr = algos.rollout_correction(
            old,
            roll,
            mask,
            rollout_is=rc.rollout_is,
            rollout_is_threshold=rc.rollout_is_threshold,
            rollout_is_batch_normalize=rc.rollout_is_batch_normalize,
        )
        rows = [weights[i, : len(r)].tolist() for i, r in enumerate(batch["response_ids"])]
        return {**batch, "rollout_is_weights": rows}, corr

    def _micro_step(self, batch, micro: MicroBatch, temperature: float, loss_fn, extra: dict) -> dict[str, float]:
        cfg = self.cfg
        fields = ["response_mask", "old_log_probs", "advantages"]
        fields += ["ref_log_probs"] if algos.actor_needs_ref(cfg) else []
        fields += ["rollout_is_weights"] if "rollout_is_weights" in batch else []
        inputs, tensors = self._micro_inputs(batch, micro.idx, *fields, filler=micro.filler)
        got = dict(zip(fields, tensors, strict=True))
        mask, old, adv = got["response_mask"], got["old_log_probs"], got["advantages"]
        # verl differentiates the entropy only when its coefficient is not 0; it is still logged
        logp, entropy = response_log_probs(
            self.model, inputs, temperature, with_entropy=True, entropy_grad=cfg.entropy_coeff != 0,
            chunk_tokens=cfg.logits_chunk_tokens,
        )  # fmt: skip
        # Exact mode (token budget, data parallel, token-sum): every term is agg_loss over the mini-batch's global
        # counts, so the accumulated (and rank-averaged) gradient is the whole mini-batch's.
        agg = micro.norm
        glob = {} if agg is None else agg.agg_kwargs()
        pg_loss, pg_metrics = loss_fn(
            old,
            logp,
            adv,
            mask,
            cfg.loss_agg_mode,
            rollout_is_weights=got.get("rollout_is_weights"),
            ref_log_prob=got.get("ref_log_probs"),  # for a loss that declares needs=("ref",); the others ignore it
            agg=agg,
            **extra
        )
        entropy_loss = algos.agg_loss(entropy, mask, cfg.loss_agg_mode, **glob)
        w_tok = 1.0 if agg is None else metric_weight(mask, agg)
        loss = pg_loss - cfg.entropy_coeff * entropy_loss
        metrics = {"actor/pg_loss": float(pg_loss.detach()), "actor/entropy": float(entropy_loss.detach())}
        if cfg.use_kl_loss:
            kl = algos.agg_loss(algos.kl_penalty(logp, got["ref_log_probs"], cfg.kl_loss_type), mask, cfg.loss_agg_mode, **glob)
            loss = loss + cfg.kl_loss_coef * kl
            metrics["actor/kl_loss"] = float(kl.detach())
            metrics["actor/kl_coef"] = cfg.kl_loss_coef * w_tok
        (loss * micro.scale).backward()
        for k, v in pg_metrics.items():
            # token means (w_tok is 1.0 in fixed-count mode); a key with a "/" is logged as named (rollout_corr/...)
            metrics[k if "/" in k else f"actor/{k}"] = float(v) * w_tok
        return metrics

    @property
    def trained_module(self) -> torch.nn.Module:
        """The module whose parameters this actor's steps change: ``model`` itself (DeepSpeed: its engine's module,
        under ZeRO-3 a copy or a partition of the policy's)."""
        return self.model

    def gather_into(self, target: torch.nn.Module | None) -> None:
        """After an update, the trained weights into ``target`` where this actor trains a partition of them
        (DeepSpeed's ZeRO-3); a no-op here: the module it trains is whole."""

    def close(self) -> None:
        """Nothing to release (a data-parallel rank's process group stays: ``destroy_process_group()`` ends it)."""


class DataParallelTorchActor(TorchActor):
    """``TorchActor`` on N ranks of a ``torch.distributed`` group (gloo on CPU, NCCL on CUDA), no DeepSpeed.

    Every rank gets the whole batch and trains its slice of each global mini-batch (``MiniBatchTrainer``'s
    layout, the same weights as ``DeepSpeedActor`` with ZeRO-0); before each step the gradients are averaged
    with one all-reduce of a flat buffer, so every rank clips and steps identically and holds the same weights.
    The group comes from the environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), started here if needed.
    """

    def __init__(self, model: torch.nn.Module, cfg, pad_id: int, total_steps: int) -> None:
        dist = torch.distributed
        if not dist.is_initialized():
            dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        super().__init__(model, cfg, pad_id, total_steps)
        self.dp_size, self.dp_rank = dist.get_world_size(), dist.get_rank()
        if cfg.ppo_mini_batch_size % self.dp_size:
            raise ValueError(
                f"actor.ppo_mini_batch_size={cfg.ppo_mini_batch_size} must be divisible by the data-parallel "
                f"world size {self.dp_size}"
            )
        self.params = [p for g in self.optimizer.param_groups for p in g["params"]]

    def _optimizer_step(self) -> float:
        for p in self.params:  # a parameter no micro-batch of this rank reached still takes part in the sum
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = [p.grad for p in self.params]
        flat = torch._utils._flatten_dense_tensors(grads)
        torch.distributed.all_reduce(flat)
        flat /= self.dp_size
        for g, reduced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads), strict=True):
            g.copy_(reduced)
        return super()._optimizer_step()

    def update(self, batch: dict[str, list], temperature: float, seed: int) -> dict[str, float]:
        """``TorchActor.update`` on this rank's slices; metrics are the ranks' means."""
        check_equal_shards(batch, self.dp_size, self.device)  # NCCL reduces tensors on the GPU
        return rank_mean(super().update(batch, temperature, seed), self.dp_size, self.device)



def check_equal_shards(batch: dict[str, list], world_size: int, device: str = "cpu") -> None:
    """Every rank of the group got a batch of the same size (else they would step on different mini-batches)."""
    n = len(batch["prompt_ids"])
    if world_size > 1:
        sizes = [torch.zeros(1, dtype=torch.long, device=device) for _ in range(world_size)]
        torch.distributed.all_gather(sizes, torch.tensor([n], device=device))
        if len({int(s) for s in sizes}) != 1:
            raise ValueError(f"data-parallel ranks got unequal batch shards: {[int(s) for s in sizes]}")


def rank_mean(metrics: dict[str, float], world_size: int, device: str = "cpu") -> dict[str, float]:
    """The mean of each metric over the group's ranks (the same keys on every rank: same config, same steps)."""
    if world_size == 1:
        return metrics
    keys = sorted(metrics)
    vals = torch.tensor([metrics[k] for k in keys], dtype=torch.float64, device=device)
    torch.distributed.all_reduce(vals)
    return {k: float(v) / world_size for k, v in zip(keys, vals.tolist(), strict=True)}
